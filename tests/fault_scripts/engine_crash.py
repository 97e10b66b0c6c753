"""The last rank's engine raises an exception of its own (a planted bug) at step 3, while every rank runs the same
asynchronous allreduces. argv[1] says where: 'executor' (while running the collective: the peers are inside the
transport waiting for it), 'agreement' (while agreeing: the peers wait in the agreement cycle). Every rank must
get an error naming the crashed rank within seconds -- not after the stall timeout -- and later calls must fail at
once; the job must end."""
import sys
import time

import numpy as np

import ringtrain as rt
from ringtrain.core import state
from _common import announce_pid, caught, done_speaking, say

where = sys.argv[1]
rt.init()
announce_pid()
victim = rt.size() - 1
engine = state.engine()


def plant(obj, method, when):
    original = getattr(obj, method)

    def planted(*args, **kwargs):
        if when(*args):
            say(f"PLANTED at {time.time():.3f}")
            raise RuntimeError(f"planted bug in the {where}")
        return original(*args, **kwargs)
    setattr(obj, method, planted)


if rt.rank() == victim:
    if where == "executor":
        plant(engine.executor, "run", lambda action, reqs: "grad.step3" in action.names)
    else:
        plant(engine.agreement, "poll", lambda *_: "grad.step3" in engine.requests)   # poll(lazy)

x = np.ones(1 << 20, np.float32)     # 4 MB: past the agreement's eager slots, so the transport runs it
try:
    for step in range(1000):
        rt.allreduce_async(x, op=rt.Sum, name=f"grad.step{step}").wait()
    say("NO ERROR although an engine crashed")
    sys.exit(3)
except rt.RingtrainError as e:
    say(f"CAUGHT-AT {time.time():.3f}")
    caught("engine_crash", e)
try:
    rt.allreduce(np.ones(4, np.float32), name="after.crash")
    say("AFTER-CRASH no error")
except rt.RingtrainError as e:
    say(f"AFTER-CRASH {type(e).__name__}")
done_speaking()
sys.exit(1)
