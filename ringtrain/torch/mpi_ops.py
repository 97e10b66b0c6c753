"""horovod.torch.mpi_ops' names, for scripts that import them from there: `from ringtrain.torch.mpi_ops import
allreduce_async, synchronize` (the same objects as ringtrain.torch's)."""
from .autograd import (allgather, allreduce, alltoall, broadcast, grouped_allgather, grouped_allreduce,  # noqa: F401
                       grouped_reducescatter, reducescatter)
from .functions import (  # noqa: F401
    Adasum, Average, Max, Min, Product, ProcessSet, ReduceOp, Sum,
    add_process_set, allgather_async, allreduce_, allreduce_async, allreduce_async_, alltoall_async, barrier,
    broadcast_, broadcast_async, broadcast_async_, ccl_built, cross_rank, cross_size, cuda_built, ddl_built,
    global_process_set, gloo_built, gloo_enabled, grouped_allgather_async, grouped_allreduce_,
    grouped_allreduce_async, grouped_allreduce_async_, grouped_reducescatter_async, init, is_homogeneous,
    is_initialized, join, local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, poll, rank,
    reducescatter_async, remove_process_set, rocm_built, shutdown, size, sparse_allreduce_async, start_timeline,
    stop_timeline, synchronize,
)
