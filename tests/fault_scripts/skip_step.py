"""Training loop where the last rank skips step 2's allreduce. The others must warn after
RINGTRAIN_STALL_WARNING_S naming the missing rank and fail that step with StallError after RINGTRAIN_STALL_TIMEOUT_S;
the stall ends only that collective, so step 3 (the skipping rank's next call) completes on every rank."""
import sys

import numpy as np

import ringtrain as rt
from _common import caught, say

rt.init()
skipper = rt.size() - 1
for step in range(4):
    if step == 2 and rt.rank() == skipper:
        continue
    try:
        got = rt.allreduce(np.ones(1000, np.float32), op=rt.Sum, name=f"grad.step{step}")
    except rt.StallError as e:
        caught("skip", e)
        continue
    if not np.array_equal(got, np.full(1000, rt.size(), np.float32)):
        say(f"WRONG step {step}: {got[:3]}")
        sys.exit(5)
say("STEPS DONE")
rt.shutdown()
