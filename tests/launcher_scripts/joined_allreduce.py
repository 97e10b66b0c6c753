"""One rank of a torch.distributed-style launch (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): init() joins the
processes into one world (or refuses with LaunchError); prints the world it got and a Sum allreduce."""
import numpy as np

import ringtrain as rt

try:
    rt.init()
except rt.RingtrainError as error:
    print(f"REFUSED {type(error).__name__}: {error}", flush=True)
    raise SystemExit(3)
total = rt.allreduce(np.full(5, rt.rank() + 1, np.int64), op=rt.Sum, name="joined")
print(f"rank {rt.rank()} of {rt.size()} via {rt.transport_name()}: {total.tolist()}", flush=True)
rt.shutdown()
