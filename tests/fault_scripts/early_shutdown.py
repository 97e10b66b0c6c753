"""The last rank calls shutdown() after step 1 while the others keep submitting. They must get
RankFailureError / ShutdownError naming that rank, within seconds, not a stall timeout.

The quitter stays alive until every other rank has caught its error (each leaves a file in RINGTRAIN_TEST_SPOKE:
_common.done_speaking) or 6 s passed, so what the others notice is the shutdown itself, never a dead process; so
does every other rank, so that the quitter is the only rank any of them can find shut down."""
import os
import sys
import time

import numpy as np

import ringtrain as rt
from _common import caught, done_speaking, say

rt.init()
quitter = rt.size() - 1
me, others = rt.rank(), rt.size() - 1
markers = os.environ["RINGTRAIN_TEST_SPOKE"]
try:
    for step in range(10):
        if step == 2 and me == quitter:
            say(f"SHUTTING DOWN EARLY at {time.time():.3f}")
            rt.shutdown()
            deadline = time.monotonic() + 6      # (past the 5 s the test allows the others)
            while len(os.listdir(markers)) < others and time.monotonic() < deadline:
                time.sleep(0.05)
            sys.exit(0)
        rt.allreduce(np.ones(100, np.float32), name=f"grad.step{step}")
except rt.RingtrainError as e:
    say(f"CAUGHT-AT {time.time():.3f}")
    caught("early_shutdown", e)
    done_speaking()
    # and waits for the other survivors' markers too: its exit would shut its engine down, so a survivor still on
    # its way to the collective would be told "ranks r,q already called shutdown()" -- and its exit code could
    # make the launcher end the others before they print
    deadline = time.monotonic() + 6
    while len(os.listdir(markers)) < others and time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit(1)
say("NO ERROR although a rank shut down early")
sys.exit(3)
