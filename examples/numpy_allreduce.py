"""Ten lines of ringtrain on numpy arrays: run with `mpirun -np 2 python examples/numpy_allreduce.py`."""
import numpy as np
import ringtrain as rt

rt.init()
grad = np.full(4, rt.rank() + 1.0, dtype=np.float32)          # rank 0 has 1s, rank 1 has 2s, ...
mean = rt.allreduce(grad, op=rt.Average, name="grad")           # our ring: reduce-scatter + allgather
rows = rt.allgather(np.full((rt.rank() + 1, 2), rt.rank()))    # first dimension may differ per rank
config = rt.broadcast_object({"lr": 0.1 * rt.size()}, root_rank=0)
print(f"rank {rt.rank()}/{rt.size()} via {rt.transport_name()}: mean={mean} rows={rows.shape[0]} config={config}")
rt.shutdown()
