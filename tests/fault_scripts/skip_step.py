"""Training loop where the last rank skips step 2's allreduce. The others must warn after
RINGTRAIN_STALL_WARNING_S naming the missing rank and fail with StallError after RINGTRAIN_STALL_TIMEOUT_S."""
import sys

import numpy as np

import ringtrain as rt
from _common import caught, say

rt.init()
skipper = rt.size() - 1
try:
    for step in range(4):
        if step == 2 and rt.rank() == skipper:
            continue
        rt.allreduce(np.ones(1000, np.float32), name=f"grad.step{step}")
except rt.RingtrainError as e:
    caught("skip", e)
    sys.exit(1)
say("NO ERROR although a rank skipped a step")
sys.exit(3)
