"""The last rank SIGKILLs itself while a large allreduce is in flight. Survivors must end within seconds,
non-zero, naming the dead rank; no process may be left behind."""
import os
import signal
import threading

import numpy as np

import ringtrain as rt
from _common import announce_pid, caught, done_speaking

rt.init()
announce_pid()
victim = rt.size() - 1
x = np.ones(4 << 20, np.float32)   # 16 MB: the ring is busy for a while
try:
    for step in range(1000):
        if step == 3 and rt.rank() == victim:
            threading.Timer(0.005, os.kill, (os.getpid(), signal.SIGKILL)).start()
        rt.allreduce(x, name=f"grad.step{step}")
except rt.RingtrainError as e:
    caught("sigkill", e)
    done_speaking()
    raise
