"""An elastic survivor sends to the worker that just died, as a send already on its way at the death does: MPI must
return (an error or not), not take the survivor with it. Rank 1 SIGKILLs itself; rank 0 waits until the driver's
word has reached its engine, lets MPI's progress see the death, then sends to rank 1 and says what happened."""
import os
import time

import numpy as np
from mpi4py import MPI

import ringtrain as rt
from ringtrain.core import state as core_state

rt.init()
comm = core_state.engine().ctrl
if rt.rank() == 1:
    os.kill(os.getpid(), 9)
deadline = time.monotonic() + 60
while core_state.engine().failed is None:
    if time.monotonic() > deadline:
        raise RuntimeError("rank 1's death never reached rank 0")
    time.sleep(0.01)
end = time.monotonic() + 0.2
while time.monotonic() < end:           # MPI's progress runs in these calls: let it see the dead connection
    comm.Iprobe(source=MPI.ANY_SOURCE, tag=99)
    time.sleep(1e-3)
try:
    request = comm.Isend([np.zeros(64, np.uint8), MPI.BYTE], dest=1, tag=99)
    for _ in range(100):
        if request.Test():
            break
        time.sleep(1e-3)
    outcome = "returned"
except MPI.Exception as e:
    outcome = f"raised error class {e.Get_error_class()}"
os.write(1, f"rank 0: SEND TO THE DEAD {outcome}\n".encode())
os._exit(0)
