"""horovod.tensorflow.mpi_ops' names, for scripts that import them from there: `from ringtrain.tensorflow.mpi_ops
import allgather, size_op` (the same objects as ringtrain.tensorflow's)."""
from .functions import (  # noqa: F401
    Average, Max, Min, Product, ProcessSet, ReduceOp, Sum,
    add_process_set, allgather, allreduce, alltoall, barrier, broadcast, ccl_built, cross_rank, cross_size,
    cuda_built, ddl_built, global_process_set, gloo_built, gloo_enabled, grouped_allgather, grouped_allreduce,
    grouped_reducescatter, init, is_homogeneous, is_initialized, join, local_rank, local_size, mpi_built,
    mpi_enabled, mpi_threads_supported, nccl_built, rank, reducescatter, remove_process_set, rocm_built, shutdown,
    size, start_timeline, stop_timeline,
)
from .topology_ops import local_rank_op, local_size_op, process_set_included_op, rank_op, size_op  # noqa: F401
