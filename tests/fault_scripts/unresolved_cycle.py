"""Rank 0's compiled express call publishes its cycle while its peers are late (NOT_YET), and its caller never
finishes that cycle (an exception between the compiled call and Engine.express, planted here by not calling it).
No rank may hang: within the stall timeout rank 0's engine fails with a StallError naming the allreduce, and every
rank's next call ends in an error naming it; the job ends."""
import sys
import time

import numpy as np
from mpi4py import MPI

import ringtrain as rt
from ringtrain.core import state
from ringtrain.engine import native_cycle
from _common import announce_pid, caught, done_speaking, say

rt.init()
announce_pid()
engine = state.engine()
x = np.ones(64, np.float32)
for _ in range(3):
    rt.allreduce(x, op=rt.Sum, name="gap.call")
MPI.COMM_WORLD.Barrier()             # (not ringtrain's barrier: a first sighting would change the cache's generation)
if engine.fast.on is False:
    say("NO COMPILED CALL")          # (the test skips then)
    sys.exit(0)
if rt.rank() == 0:
    plan = engine.memo.get(("gap.call", rt.Sum, x.dtype, x.shape, 1.0, 1.0))
    with engine._progress_lock:
        engine.fast.take()
        engine.fast.arm()
    outcome = plan.fast[0](plan.fast, x, np.empty_like(x))
    say(f"OUTCOME {outcome}")
    if outcome != native_cycle.NOT_YET:
        sys.exit(4)
else:
    time.sleep(0.5)
try:
    for step in range(3):
        rt.allreduce(x, op=rt.Sum, name=f"gap.next{step}")
    say("NO ERROR although a cycle was left unresolved")
    sys.exit(3)
except rt.RingtrainError as e:
    caught("unresolved", e)
    done_speaking()
sys.exit(1)
