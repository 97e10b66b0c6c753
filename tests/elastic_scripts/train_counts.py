"""An elastic torch job whose result shows what was trained: parameter `counts[i]` gains exactly 1 each time sample
i is in a step of the committed trajectory (gradient -onehot, SGD lr 1, op Sum), so after an epoch the job is right
iff counts == 1 everywhere. A small Linear with momentum SGD gives the optimizer real state to commit and restore.

Environment (set by tests/test_elastic.py):
  FAIL_AT_START_ON_HOST=h  exit 3 at once on host h (the blacklist case)
  KILL_RANK=r KILL_STEP=s  in the first world, rank r SIGKILLs itself as step s begins (commits follow odd steps,
                           so with s odd the survivors hold one uncommitted step that the roll-back must undo)
  KILL_AFTER_STEP=s        the same, but once step s returned on every rank (STEP_MARKS_DIR=d: an empty directory
                           for the marks), before recording it (a commit follows odd s)
  LATE_RANK=r              with KILL_*: rank r fails right after the killed rank's last whole step (s-1, or s with
                           KILL_AFTER_STEP), before recording it (late_failure.py)
  GROW_HOSTS_FILE=f        in the first world, rank 0 adds a slot to the discovery file f at step GROW_STEP and
                           every rank keeps committing until the new worker has joined
Lines: "rank r: START size=n digest=d" each time train() starts (after sync), "rank r: RESET live=d committed=d"
after each roll-back, "rank r: FINAL size=n digest=d counts=ok|<list>".
"""
import hashlib
import os
import sys
import time

if os.environ.get("FAIL_AT_START_ON_HOST") and os.environ.get("RINGTRAIN_ELASTIC_HOST") == os.environ[
        "FAIL_AT_START_ON_HOST"]:
    print(f"worker on {os.environ['RINGTRAIN_ELASTIC_HOST']}: failing at start on purpose", flush=True)
    sys.exit(3)

import torch  # noqa: E402

import ringtrain.torch as hvd  # noqa: E402
from late_failure import fail_with_the_world  # noqa: E402

torch.set_num_threads(1)
N, BATCH = int(os.environ.get("SAMPLES", "96")), 4
STEP_SLEEP_S = float(os.environ.get("STEP_SLEEP_S", "0.02"))
KILL_STEP, KILL_AFTER_STEP = (int(os.environ.get(name, "-1")) for name in ("KILL_STEP", "KILL_AFTER_STEP"))
LAST_FULL_STEP = KILL_AFTER_STEP if KILL_AFTER_STEP >= 0 else KILL_STEP - 1

hvd.init()
torch.manual_seed(0)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 1)
        self.counts = torch.nn.Parameter(torch.zeros(N))


model = Model()
# counts without momentum (each step adds exactly its samples); the linear layer with it (optimizer state)
groups = [{"params": [model.counts], "momentum": 0.0}, {"params": model.linear.parameters(), "momentum": 0.5}]
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(groups, lr=1.0),
                                     named_parameters=model.named_parameters(), op=hvd.Sum)
sampler = hvd.elastic.ElasticSampler(list(range(N)), shuffle=True, seed=7)
# first_size: the first world's size, which sync() hands to workers that join later
state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, step=0, first_size=hvd.size())
last_commit = {"digest": None}


def say(text):
    os.write(1, f"rank {hvd.rank()}: {text}\n".encode())     # one write: the workers share one pipe


def digest():
    h = hashlib.sha256()
    for value in model.state_dict().values():
        h.update(value.detach().numpy().tobytes())
    for group in optimizer.state_dict()["state"].values():
        for value in group.values():
            h.update(value.numpy().tobytes() if torch.is_tensor(value) else repr(value).encode())
    h.update(repr((sorted(sampler.processed_indices), sampler.epoch, state.epoch, state.step)).encode())
    return h.hexdigest()[:16]


def commit():
    last_commit["digest"] = digest()        # save() copies exactly this state
    state.commit()


def on_reset():
    say(f"RESET live={digest()} committed={last_commit['digest']}")


state.register_reset_callbacks([on_reset])


def step(indices):
    optimizer.zero_grad()
    onehot = torch.zeros(N)
    onehot[indices] = 1.0
    x = torch.arange(3.0) * 0.01 * (1 + len(indices))
    loss = -(model.counts * onehot).sum() + 0.001 * model.linear(x).sum()
    loss.backward()
    optimizer.step()


def wait_for_join():
    """Every rank commits until the new worker is in (the commit raises HostsUpdatedInterrupt)."""
    if hvd.rank() == 0:
        with open(os.environ["GROW_HOSTS_FILE"], "a") as f:
            f.write("localhost:1\n")
    for _ in range(300):
        time.sleep(0.1)
        commit()
    raise RuntimeError("the new worker never joined")


def kill_once_every_rank_has_stepped():
    """KILL_AFTER_STEP: each rank marks in STEP_MARKS_DIR that its step returned; the killed rank dies once every
    rank has (so no survivor is still inside that step's allreduce: a survivor that is not LATE_RANK goes on to
    record the step and save the commit that follows)."""
    marks = os.environ["STEP_MARKS_DIR"]
    open(os.path.join(marks, f"rank{hvd.rank()}"), "w").close()
    if str(hvd.rank()) != os.environ.get("KILL_RANK"):
        return
    deadline = time.monotonic() + 60
    while len(os.listdir(marks)) < hvd.size():
        if time.monotonic() > deadline:
            raise RuntimeError("not every rank finished the step")
        time.sleep(0.01)
    die()


def die():
    say(f"KILLED at {time.time():.3f}")
    os.kill(os.getpid(), 9)


@hvd.elastic.run(rollback=True)     # Horovod's mode: these cases check the roll-back to the last commit
def train(state):
    say(f"START size={hvd.size()} digest={digest()}")
    while state.epoch < 1:
        for batch in range(state.sampler.steps(BATCH)):
            in_first_world = hvd.size() == state.first_size and state.step < 1000
            if in_first_world and os.environ.get("GROW_HOSTS_FILE") and batch == int(os.environ["GROW_STEP"]):
                wait_for_join()
            if in_first_world and str(hvd.rank()) == os.environ.get("KILL_RANK") and batch == KILL_STEP:
                die()
            step(state.sampler.get_indices(batch, BATCH))
            if in_first_world and batch == KILL_AFTER_STEP:
                kill_once_every_rank_has_stepped()
            if in_first_world and str(hvd.rank()) == os.environ.get("LATE_RANK") and batch == LAST_FULL_STEP:
                fail_with_the_world()
            state.sampler.record_batch(batch, BATCH)
            state.step += 1
            time.sleep(STEP_SLEEP_S)
            if batch % 2 == 1:
                commit()
        state.epoch += 1
        state.step = 1000          # past the first world's special steps, whatever the world
        state.sampler.set_epoch(state.epoch)
        commit()


train(state)
# after the epoch's last commit: counts hold one epoch (set_epoch only resets the sampler)
counts = model.counts.detach()
ok = bool(torch.equal(counts, torch.ones(N)))
say(f"FINAL size={hvd.size()} digest={digest()} counts={'ok' if ok else counts.int().tolist()}")
