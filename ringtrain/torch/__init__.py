"""ringtrain for PyTorch, with Horovod's names: `import ringtrain.torch as hvd` and a horovod.torch script runs.

    import ringtrain.torch as hvd
    hvd.init()
    model = Net().to(hvd.device())
    opt = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)

docs/porting/horovod.md lists every horovod.torch name and how ours differs.
"""
from ringtrain.errors import (RankFailureError, RingtrainError, StallError, TensorMismatchError,  # noqa: F401
                              UnsupportedDtypeError, UnsupportedOperationError)

from ringtrain.core.observe import dump_flight_recorder, straggler_report  # noqa: F401
from .broadcast import broadcast_optimizer_state, broadcast_parameters  # noqa: F401
from .checkpoint import *  # noqa: F401,F403
from .compression import Compression  # noqa: F401
from . import elastic  # noqa: F401  -- hvd.elastic
from .consistency import *  # noqa: F401,F403
from .functions import (  # noqa: F401
    Adasum, Average, Max, Min, Product, ProcessSet, ReduceOp, Sum,
    add_process_set, allgather_async, allgather_object, allreduce_, allreduce_async, allreduce_async_,
    alltoall_async, barrier, broadcast_, broadcast_async, broadcast_async_, broadcast_object,
    ccl_built, cross_rank, cross_size, cuda_built, ddl_built, device, global_process_set, gloo_built, gloo_enabled,
    grouped_allgather_async, grouped_allreduce_, grouped_allreduce_async, grouped_allreduce_async_,
    grouped_reducescatter_async, init, is_homogeneous, is_initialized, join, local_rank, local_size, mpi_built,
    mpi_enabled, mpi_threads_supported, nccl_built, poll, rank, reducescatter_async, remove_process_set, rocm_built,
    shutdown, size, sparse_allreduce_async, start_timeline, stop_timeline, synchronize,
)
from .optimizer import DistributedOptimizer  # noqa: F401
from .shared import empty_shared  # noqa: F401
from .sync_batch_norm import SyncBatchNorm  # noqa: F401
# last: the submodule ringtrain.torch.broadcast must not shadow the function hvd.broadcast
from .autograd import (allgather, allreduce, alltoall, broadcast, grouped_allgather, grouped_allreduce,  # noqa: F401
                       grouped_reducescatter, reducescatter)

# `except hvd.HorovodInternalError` catches every error ringtrain raises on purpose
HorovodInternalError = RingtrainError
