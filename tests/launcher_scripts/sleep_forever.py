"""Every rank writes its pid to DIR/rank<r>.pid (argv[1]) and sleeps until it is stopped.

With argv[2] == 'ignore-sigterm' the ranks shrug off SIGTERM and SIGINT, so only a SIGKILL ends them."""
import os
import signal
import sys
import time

from mpi4py import MPI

rank = MPI.COMM_WORLD.Get_rank()
if sys.argv[2:3] == ["ignore-sigterm"]:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
path = os.path.join(sys.argv[1], f"rank{rank}.pid")
with open(path + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(path + ".tmp", path)        # atomic: the test never reads a half-written pid
while True:
    time.sleep(0.05)
