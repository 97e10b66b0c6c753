"""A root's broadcast, then a small allreduce, with the Watchdog's peer checks out of reach (the test sets
RINGTRAIN_PEER_CHECK_S high). In an elastic world every message goes through MPICH's network module, which moves
data only inside MPI calls: rank 0's broadcast is done on rank 0 while its data may still sit there, and rank 0 then
waits for rank 1 in the allreduce's cycle, on shared memory. Only the waits' own MPI progress lets rank 1 finish the
broadcast; without it both ranks wait until the stall timeout ends the job."""
import os

import numpy as np

import ringtrain as rt

rt.init()
rank = rt.rank()
for step in range(3):
    big = np.full(2 << 20, rank + step, np.float32)          # 8 MB: well past any eager limit
    got = rt.broadcast(big, root_rank=0, name=f"big.{step}")
    small = rt.allreduce(np.full(4, rank + 1.0, np.float32), op=rt.Sum, name=f"small.{step}")
    ok = bool((got == step).all() and (small == rt.size() * (rt.size() + 1) / 2).all())
    os.write(1, f"rank {rank}: STEP step={step} ok={ok}\n".encode())     # one write: lines never interleave
rt.shutdown()
