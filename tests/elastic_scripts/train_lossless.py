"""An elastic torch job whose final state a one-process replay checks: one optimizer (OPTIMIZER=sgd: SGD with
momentum; adam: Adam), op=Average, a fixed data order, and a record of every step the final state went through.

Every rank keeps `state.history` (a state attribute: handed over with the model in sync): for each completed step,
the world's size and every rank's sample indices. At the end rank 0 prints it with the parameters and the optimizer
state; the test (tests/test_elastic_lossless.py) replays the history in one process -- each rank's gradient on its
own samples, averaged over that step's world size, one optimizer step -- and compares, and checks that the history
trains every sample exactly once.

Lossless mode (the default) has no commit() here at all. SHARD=optimizer or gradients: a sharded optimizer
(DistributedOptimizer(..., shard=SHARD)); the final optimizer state is then consolidated on rank 0. ROLLBACK=1 runs Horovod's roll-back mode with a commit
every COMMIT_EVERY steps.
Environment: KILL_RANK=r[,r2...] KILL_STEP=s KILL_AT=where: in the first world (KILL_WORLD=n: the n-th), rank r
(each listed) SIGKILLs itself in step s (of that world's train()) --
  before     as the step begins
  backward   after its backward pass (its gradients may be on their way)
  in_step    inside optimizer.step(), before its gradients are reduced
  after_step after optimizer.step() returned, before the step is recorded
  timer:t    t seconds into the step (a thread), wherever the step is then
SYNC_KILL=1: in the second world, its last rank dies half way through sync() (die_during_the_second_sync).
FORM_KILL=r: rank r of the first world dies when the second world's plan reaches it (while that world forms).
FORM_KILL_AT=mpi (with FORM_KILL=r): rank r dies inside the second world's formation instead, past the formation
barrier: as a joiner when the driver tells it to connect (the members are inside MPI's Accept for it, which times
out), as that world's rank 0 half a second into its MPI Accept (its first joiner, told to connect, waits a second
and learns first that the world was abandoned).
HANG_RANK=r: in that world, rank r (a survivor) hangs in a blocking C call in step KILL_STEP once the driver
told it of the death there ("rank r: HANGING"), where no abort reaches it (as in a hung MPI_Abort).
JOIN=1: a worker started later (after the blacklist cooldown) must join; the smaller world waits for the news of it.
SHRINK_HOSTS_FILE=f SHRINK_STEP=s: after step s of the first world rank 0 writes one slot fewer into the discovery
file f, and the world waits for the news: the last slot's worker must leave at the next step boundary.
Lines: "rank r: GPU slot=s device_of_2=d" at start, "rank r: REDEALT n steps=k size=w" each time train() starts
(n: samples a step of the last world was dealt that no completed step consumed, dealt again now; k: the steps
completed so far; w: the world's size), "rank r: FINAL size=n digest=d" on every rank (d: of its parameters and optimizer state); rank 0 also prints "rank 0: REFERENCE <json>".
"""
import ctypes
import faulthandler
import hashlib
import json
import os
import signal
import threading
import time

import torch

import ringtrain.torch as hvd
from ringtrain import gpu
from ringtrain.core import collectives
from ringtrain.core import state as core_state
from ringtrain.world import elastic_worker

torch.set_num_threads(1)
N, BATCH, FEATURES = 48, 2, 3
LR = {"sgd": 0.05, "adam": 0.02}
OPTIMIZER = os.environ.get("OPTIMIZER", "sgd")
KILL_STEP = int(os.environ.get("KILL_STEP", "-1"))
KILL_AT = os.environ.get("KILL_AT", "before")
ROLLBACK = os.environ.get("ROLLBACK") == "1"
COMMIT_EVERY = int(os.environ.get("COMMIT_EVERY", "2"))
SHARD = os.environ.get("SHARD") or None

faulthandler.register(signal.SIGUSR1)      # a hung worker's stack: kill -USR1 <pid>

hvd.init()


def data():
    """Sample i: a fixed input row and target, the same in the test's replay."""
    g = torch.Generator().manual_seed(11)
    return torch.randn(N, FEATURES, generator=g, dtype=torch.float64), torch.randn(N, 2, generator=g,
                                                                                    dtype=torch.float64)


def make_model():
    torch.manual_seed(0)
    return torch.nn.Linear(FEATURES, 2).double()


def make_optimizer(params, name):
    if name == "sgd":
        return torch.optim.SGD(params, lr=LR[name], momentum=0.9)
    return torch.optim.Adam(params, lr=LR[name])


def loss_on(model, x, y, indices):
    """Sum of squared errors over this rank's samples, divided by the batch size (an empty shard gives zero)."""
    return ((model(x[indices]) - y[indices]) ** 2).sum() / BATCH


X, Y = data()
model = make_model()
optimizer = hvd.DistributedOptimizer(make_optimizer(model.parameters(), OPTIMIZER),
                                     named_parameters=model.named_parameters(), op=hvd.Average, shard=SHARD)
sampler = hvd.elastic.ElasticSampler(list(range(N)), shuffle=True, seed=5)
state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, history=[], first_size=hvd.size())
attempted = set()        # every rank's samples of each step this process began, since train() last started


def say(text):
    os.write(1, f"rank {hvd.rank()}: {text}\n".encode())     # one write: the workers share one pipe


say(f"GPU slot={elastic_worker.slot()} "
    f"device_of_2={gpu.choose_device(core_state.gpu_index(hvd.local_rank()), 2)}")


def die():
    say(f"KILLED at {time.time():.3f} ({KILL_AT})")
    os.kill(os.getpid(), 9)


def in_first_world():
    return elastic_worker.client().generation == 1


def in_kill_world():
    """KILL_WORLD=n (1 by default): the world whose ranks KILL_RANK, KILL_STEP and HANG_RANK name."""
    return elastic_worker.client().generation == int(os.environ.get("KILL_WORLD", "1"))


def doomed():
    """KILL_RANK=r or r,s,...: the ranks of the first world that die."""
    return str(hvd.rank()) in os.environ.get("KILL_RANK", "").split(",")


def kill_here(where, batch):
    if where == KILL_AT and batch == KILL_STEP and in_kill_world() and doomed():
        die()


def hang_here(batch):
    """HANG_RANK=r: rank r of KILL_WORLD blocks in libc's sleep() in step KILL_STEP, after the death."""
    if batch != KILL_STEP or not in_kill_world() or str(hvd.rank()) != os.environ.get("HANG_RANK"):
        return
    driver = elastic_worker.client()
    deadline = time.monotonic() + 60
    while driver.generation not in driver.failed_generations and time.monotonic() < deadline:
        time.sleep(0.01)
    say(f"HANGING at {time.time():.3f}")
    ctypes.CDLL(None).sleep(600)


def in_step_kill(opt, args, kwargs):
    kill_here("in_step", current["batch"])


current = {"batch": -1}
if SHARD is None:
    optimizer.register_step_pre_hook(in_step_kill)
else:       # (a sharded optimizer's step does not run torch's step hooks)
    sharded_step = optimizer._ringtrain.step
    optimizer._ringtrain.step = lambda: (in_step_kill(None, None, None), sharded_step())[1]


def die_during_the_second_sync():
    """SYNC_KILL=1: in the second world, its last rank other than the source dies inside sync(), once the sampler's
    record and the parameters were handed over and before the optimizer state is: the others' sync breaks half
    way."""
    inner = state.sync_from

    def sync_from(root):
        victim = hvd.size() - 1 if root != hvd.size() - 1 else hvd.size() - 2
        if elastic_worker.client().generation == 2 and hvd.rank() == victim:
            for handler in list(state._handlers.values())[:2]:      # the sampler's record and the parameters
                handler.sync(root)
            say(f"KILLED in sync at {time.time():.3f}")
            os.kill(os.getpid(), 9)
        inner(root)
    state.sync_from = sync_from


if os.environ.get("SYNC_KILL") == "1":
    die_during_the_second_sync()


def die_when_the_second_world_is_planned():
    """FORM_KILL=r[,s...]: these ranks of the first world die as the second world's plan reaches them, before they
    answer it (a death while the world forms)."""
    driver = elastic_worker.client()
    expect = driver.expect
    rank = hvd.rank()

    def expect_or_die(op, timeout_s, also=(), **kwargs):
        message = expect(op, timeout_s, also, **kwargs)
        if message.get("op") == "world" and message["generation"] == 2:
            os.write(1, f"rank {rank}: KILLED while world 2 formed at {time.time():.3f}\n".encode())
            os.kill(os.getpid(), 9)
        return message
    driver.expect = expect_or_die


def die_inside_the_second_worlds_formation(victim):
    """FORM_KILL_AT=mpi: rank `victim` of the first world dies inside the second world's formation (see the module
    doc); the others' part: a joiner of that world waits a second before it Connects when the victim is its rank 0."""
    driver = elastic_worker.client()
    first = {"accept": True, "connect": True}
    survivors = [r for r in range(hvd.size()) if str(r) not in os.environ.get("KILL_RANK", "").split(",")]
    victim_is_root = survivors and survivors[0] == victim
    accept_one, connect = elastic_worker._accept_one, elastic_worker._connect

    def die(where):
        os.write(1, f"rank {victim}: KILLED inside the formation of world 2 ({where}) at {time.time():.3f}\n".encode())
        os.kill(os.getpid(), 9)

    def accept_and_die(world, port, info):
        if hvd_rank == victim and driver.generation == 1 and first.pop("accept", False):
            threading.Timer(0.5, die, args=("in MPI's Accept",)).start()
        return accept_one(world, port, info)

    def connect_or_die(driver_, generation, port, info):
        if driver.generation == 1 and first.pop("connect", False):
            if hvd_rank == victim:
                die("told to connect; the others are in MPI's Accept")
            if victim_is_root:
                time.sleep(1.0)
        return connect(driver_, generation, port, info)
    elastic_worker._accept_one, elastic_worker._connect = accept_and_die, connect_or_die


hvd_rank = hvd.rank()
if os.environ.get("FORM_KILL_AT") == "mpi":
    die_inside_the_second_worlds_formation(int(os.environ["FORM_KILL"]))
elif str(hvd.rank()) in os.environ.get("FORM_KILL", "").split(","):
    die_when_the_second_world_is_planned()


def report_redealt():
    """After a failure: the samples this world's steps began with that no completed step consumed (re-dealt)."""
    consumed = set(sampler.processed_indices)
    lost = collectives.allgather_object(sorted(attempted - consumed))
    redealt = set(i for part in lost for i in part)
    say(f"REDEALT {len(redealt)} steps={len(state.history)} size={hvd.size()}")


def wait_for_news(batch):
    """JOIN=1, in the world the failure left; SHRINK_HOSTS_FILE=f, in the first world from step SHRINK_STEP (rank 0
    then writes one slot fewer into f): wait (up to 60 s) until the driver announced the change (only the pace
    changes: the next step boundary then acts on it)."""
    driver = elastic_worker.client()
    joining = os.environ.get("JOIN") == "1" and hvd.size() < state.first_size
    shrinking = os.environ.get("SHRINK_HOSTS_FILE") and in_first_world() and batch >= int(os.environ["SHRINK_STEP"])
    if not (joining or shrinking) or driver.generation in heard:
        return
    if shrinking and hvd.rank() == 0:
        with open(os.environ["SHRINK_HOSTS_FILE"] + ".new", "w") as f:
            f.write(f"localhost:{state.first_size - 1}\n")
        os.replace(os.environ["SHRINK_HOSTS_FILE"] + ".new", os.environ["SHRINK_HOSTS_FILE"])   # whole or not
    deadline = time.monotonic() + 60
    while driver.host_updates.empty() and time.monotonic() < deadline:
        time.sleep(0.02)
    heard.append(driver.generation)


heard = []


@hvd.elastic.run(rollback=ROLLBACK)
def train(state):
    report_redealt()            # collective: every member of a new world starts train() once
    attempted.clear()
    while state.epoch < 1:
        for batch in range(state.sampler.steps(BATCH)):
            current["batch"] = batch
            shards = [shard[batch * BATCH:(batch + 1) * BATCH] for shard in state.sampler._shards()]
            attempted.update(i for shard in shards for i in shard)
            if in_kill_world() and KILL_AT.startswith("timer:") and batch == KILL_STEP and doomed():
                threading.Timer(float(KILL_AT.split(":")[1]), die).start()
            kill_here("before", batch)
            hang_here(batch)
            optimizer.zero_grad()
            loss_on(model, X, Y, state.sampler.get_indices(batch, BATCH)).backward()
            kill_here("backward", batch)
            optimizer.step()
            kill_here("after_step", batch)
            state.history = state.history + [[hvd.size(), shards]]
            state.sampler.record_batch(batch, BATCH)
            wait_for_news(batch)
            time.sleep(float(os.environ.get("STEP_SLEEP", "0.01")))
            if ROLLBACK and len(state.history) % COMMIT_EVERY == 0:
                state.commit()
        state.epoch += 1
        state.sampler.set_epoch(state.epoch)
        if ROLLBACK:
            state.commit()


def optimizer_states():
    """Each parameter's optimizer state (a sharded optimizer's consolidated: collective), on rank 0."""
    if SHARD is None:
        return [optimizer.state[p] for p in model.parameters()]
    optimizer.consolidate_state_dict(0)
    if hvd.rank() != 0:
        return None
    whole = optimizer.state_dict()["state"]
    return [whole.get(i, {}) for i in range(len(list(model.parameters())))]


def digest(states):
    """Of the parameters and (unsharded: every rank's own) optimizer state."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    for entry in (states if SHARD is None else []):
        for key, value in sorted(entry.items()):
            h.update(key.encode() + (value.numpy().tobytes() if torch.is_tensor(value) else repr(value).encode()))
    return h.hexdigest()[:16]


train(state)
states = optimizer_states()
say(f"FINAL size={hvd.size()} digest={digest(states)}")
if hvd.rank() == 0:
    optimizer_state = [{k: (v.tolist() if torch.is_tensor(v) else v) for k, v in entry.items()} for entry in states]
    say("REFERENCE " + json.dumps({"history": state.history, "params": [p.tolist() for p in model.parameters()],
                                   "optimizer": optimizer_state}))
