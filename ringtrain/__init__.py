"""ringtrain: data-parallel training with our own ring allreduce over MPI, shared memory, NCCL and CUDA IPC.

    import ringtrain as rt
    rt.init()
    total = rt.allreduce(np.ones(4, np.float32), op=rt.Sum)   # == size() everywhere

Arrays are numpy arrays on the CPU and cupy arrays on GPUs; `bfloat16` is ml_dtypes' bfloat16 numpy dtype, which
numpy itself lacks. The torch binding (Horovod names, DistributedOptimizer) is ringtrain.torch; TensorFlow's and
Keras's are ringtrain.tensorflow and ringtrain.keras.
"""
from . import errors
from .core.collectives import (allgather, allgather_async, allgather_object, allreduce, allreduce_async,
                               alltoall, alltoall_async, barrier, broadcast, broadcast_async, broadcast_object, grouped_allgather,
                               grouped_allgather_async, grouped_allreduce, grouped_allreduce_async, grouped_reducescatter,
                               grouped_reducescatter_async, join, poll, reducescatter, reducescatter_async, synchronize)
from .errors import (NotInitializedError, RankFailureError, RingtrainError, ShutdownError, StallError,
                     TensorMismatchError, TransportError, UnsupportedDtypeError, UnsupportedOperationError)
from .engine.handle import Handle
from .core.process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from .ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum, bfloat16
from .core.shared_arrays import empty_shared
from .core.observe import dump_flight_recorder, flight_recorder_dir, straggler_report
from .core.state import (config, cross_rank, cross_size, gpu_device, init, is_homogeneous, is_initialized,
                         local_rank, local_size, rank, shutdown, size, start_timeline, stop_timeline, transport_name)

__version__ = "0.1.0"
