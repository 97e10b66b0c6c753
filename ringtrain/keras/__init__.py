"""ringtrain for Keras 3 on the TensorFlow backend, with Horovod's names: `import ringtrain.keras as hvd`.

    import keras
    import ringtrain.keras as hvd
    hvd.init()
    model = build_model()
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.001 * hvd.size()))
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()], epochs=5, verbose=hvd.verbose(),
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()])
"""
import keras as _keras

from ringtrain.tensorflow import (  # noqa: F401
    Adasum, Average, Compression, DistributedGradientTape, Max, Min, ProcessSet, Product, RankFailureError, ReduceOp,
    RingtrainError, StallError, Sum, TensorMismatchError, UnsupportedDtypeError,
    add_process_set, allgather, allgather_object, allreduce, alltoall, barrier, broadcast, broadcast_,
    broadcast_global_variables, broadcast_object, broadcast_variables, ccl_built, cross_rank, cross_size, cuda_built,
    ddl_built, global_process_set, gloo_built, gloo_enabled, grouped_allgather, grouped_allreduce,
    grouped_reducescatter, init, is_homogeneous, is_initialized, join, local_rank, local_rank_op, local_size,
    local_size_op, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank, rank_op, reducescatter,
    remove_process_set, rocm_built, shutdown, size, size_op, start_timeline, stop_timeline,
)

from ringtrain.core.observe import dump_flight_recorder, straggler_report  # noqa: F401
from . import callbacks  # noqa: F401
from . import elastic  # noqa: F401  -- hvd.elastic
from ringtrain.tensorflow.sync_batch_norm import SyncBatchNormalization  # noqa: F401
from .optimizer import DistributedOptimizer, PartialDistributedOptimizer, load_model  # noqa: F401
from .rank_zero import print0, rank_zero_only, verbose  # noqa: F401

if not _keras.__version__.startswith("3."):
    raise ImportError(f"ringtrain.keras needs Keras 3, found keras {_keras.__version__}")
if _keras.backend.backend() != "tensorflow":
    raise ImportError(f"ringtrain.keras needs the TensorFlow backend (KERAS_BACKEND=tensorflow), "
                      f"found {_keras.backend.backend()!r}")
