"""ringtrain for PyTorch, with Horovod's names: `import ringtrain.torch as hvd` and a horovod.torch script runs.

    import ringtrain.torch as hvd
    hvd.init()
    model = Net().to(hvd.device())
    opt = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
"""
from ringtrain.errors import (RankFailureError, RingtrainError, StallError, TensorMismatchError,  # noqa: F401
                              UnsupportedDtypeError)

from .broadcast import broadcast_optimizer_state, broadcast_parameters
from .compression import Compression
from .functions import (
    Average, Max, Min, Product, ReduceOp, Sum,
    allgather, allgather_async, allgather_object,
    allreduce, allreduce_, allreduce_async, allreduce_async_,
    alltoall, alltoall_async, barrier,
    broadcast, broadcast_, broadcast_async, broadcast_async_, broadcast_object,
    cross_rank, cross_size, device, grouped_allreduce, grouped_allreduce_, grouped_allreduce_async,
    grouped_allreduce_async_, init, is_initialized, join, local_rank, local_size, poll, rank,
    reducescatter, reducescatter_async, shutdown, size, synchronize,
)
from .optimizer import DistributedOptimizer

# checkpoint.py and consistency.py are written separately; export them when present
try:
    from .checkpoint import *  # noqa: F401,F403
except ImportError as error:
    if error.name != __name__ + ".checkpoint":
        raise
try:
    from .consistency import *  # noqa: F401,F403
except ImportError as error:
    if error.name != __name__ + ".consistency":
        raise
