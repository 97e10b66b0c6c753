"""Runs allreduces for a long time; the test signals the launcher (ringtrain-run) and expects every rank to stop."""
import time

import numpy as np

import ringtrain as rt
from _common import announce_pid, say

rt.init()
announce_pid()
for step in range(100000):
    rt.allreduce(np.ones(1 << 12, np.float32), name=f"grad.step{step}")
    if step == 5:
        say("RUNNING")
    time.sleep(0.001)
