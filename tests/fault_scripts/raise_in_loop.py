"""Rank 1 raises an ordinary Python exception inside the training loop (uncaught), while the others are
inside the next allreduce. The job must end non-zero, quickly, and say which rank failed."""
import numpy as np

import ringtrain as rt
from _common import announce_pid, caught, done_speaking

rt.init()
announce_pid()
try:
    for step in range(1000):
        if step == 3 and rt.rank() == 1:
            raise RuntimeError("user code failed on rank 1 at step 3")
        rt.allreduce(np.ones(1 << 16, np.float32), name=f"grad.step{step}")
except rt.RingtrainError as e:
    caught("raise", e)
    done_speaking()
    raise
