"""The last rank calls shutdown() after step 1 while the others keep submitting. They must get
RankFailureError / ShutdownError naming that rank, within seconds, not a stall timeout."""
import sys
import time

import numpy as np

import ringtrain as rt
from _common import caught, say

rt.init()
quitter = rt.size() - 1
me = rt.rank()
try:
    for step in range(10):
        if step == 2 and me == quitter:
            say(f"SHUTTING DOWN EARLY at {time.time():.3f}")
            rt.shutdown()
            time.sleep(6)        # stay alive: the others must notice the shutdown itself, not a dead process
            sys.exit(0)
        rt.allreduce(np.ones(100, np.float32), name=f"grad.step{step}")
except rt.RingtrainError as e:
    say(f"CAUGHT-AT {time.time():.3f}")
    caught("early_shutdown", e)
    sys.exit(1)
say("NO ERROR although a rank shut down early")
sys.exit(3)
