"""An elastic torch job whose final state a one-process replay can check: momentum SGD (real optimizer state),
op=Average, and a record of every step of the committed trajectory.

Every rank keeps `state.history`, committed and restored with the model: for each step, the world's size and every
rank's sample indices. A step undone by a roll-back leaves the history with it, so at the end the history is exactly
the trajectory the parameters went through. Rank 0 prints it with the parameters and the momentum buffers; the test
(tests/test_elastic.py) replays the history in one process -- each rank's gradient on its own samples, averaged over
that step's world size, one momentum-SGD step -- and compares. A roll-back that kept the optimizer's live momentum,
or an Average over the wrong number of ranks, shows as a difference.

Environment: KILL_RANK=r KILL_STEP=s: in the first world, rank r SIGKILLs itself as step s begins (a commit follows
every odd step, so with s odd the survivors hold one uncommitted step that the roll-back must undo).
Lines: "rank r: GPU slot=s device_of_2=d" at start (the GPU this worker binds on a host with 2 devices: by its
slot, which does not change from world to world), "rank r: FINAL size=n" on every rank; rank 0 also prints "rank 0: REFERENCE <json>".
"""
import json
import os
import time

import torch

import ringtrain.torch as hvd
from ringtrain import gpu
from ringtrain.core import state as core_state
from ringtrain.world import elastic_worker

torch.set_num_threads(1)
N, BATCH, FEATURES = 60, 3, 3
KILL_STEP = int(os.environ.get("KILL_STEP", "-1"))

hvd.init()


def data():
    """Sample i: a fixed input row and target, the same in the test's replay."""
    g = torch.Generator().manual_seed(11)
    return torch.randn(N, FEATURES, generator=g, dtype=torch.float64), torch.randn(N, 2, generator=g,
                                                                                    dtype=torch.float64)


def make_model():
    torch.manual_seed(0)
    return torch.nn.Linear(FEATURES, 2).double()


def loss_on(model, x, y, indices):
    """Sum of squared errors over this rank's samples, divided by the batch size (an empty shard gives zero)."""
    return ((model(x[indices]) - y[indices]) ** 2).sum() / BATCH


X, Y = data()
model = make_model()
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                     named_parameters=model.named_parameters(), op=hvd.Average)
sampler = hvd.elastic.ElasticSampler(list(range(N)), shuffle=True, seed=5)
state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, history=[], first_size=hvd.size())


def say(text):
    os.write(1, f"rank {hvd.rank()}: {text}\n".encode())     # one write: the workers share one pipe


say(f"GPU slot={elastic_worker.slot()} "
    f"device_of_2={gpu.choose_device(core_state.gpu_index(hvd.local_rank()), 2)}")


@hvd.elastic.run
def train(state):
    while state.epoch < 1:
        for batch in range(state.sampler.steps(BATCH)):
            in_first_world = hvd.size() == state.first_size
            if in_first_world and str(hvd.rank()) == os.environ.get("KILL_RANK") and batch == KILL_STEP:
                say(f"KILLED at {time.time():.3f}")
                os.kill(os.getpid(), 9)
            shards = [shard[batch * BATCH:(batch + 1) * BATCH] for shard in state.sampler._shards()]
            optimizer.zero_grad()
            loss_on(model, X, Y, state.sampler.get_indices(batch, BATCH)).backward()
            optimizer.step()
            state.history = state.history + [[hvd.size(), shards]]
            state.sampler.record_batch(batch, BATCH)
            time.sleep(0.02)
            if batch % 2 == 1:
                state.commit()
        state.epoch += 1
        state.sampler.set_epoch(state.epoch)
        state.commit()


train(state)
say(f"FINAL size={hvd.size()}")
if hvd.rank() == 0:
    momentum = [optimizer.state[p]["momentum_buffer"].tolist() for p in model.parameters()]
    say("REFERENCE " + json.dumps({"history": state.history, "params": [p.tolist() for p in model.parameters()],
                                   "momentum": momentum}))
