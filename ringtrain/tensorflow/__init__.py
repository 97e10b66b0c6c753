"""ringtrain for TensorFlow 2, with Horovod's names: `import ringtrain.tensorflow as hvd` and a horovod.tensorflow
script runs.

    import ringtrain.tensorflow as hvd
    hvd.init()

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)      # averaged over all ranks
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    hvd.broadcast_variables(model.variables, root_rank=0)           # after the model is built
Keras 3 (model.fit) is ringtrain.keras.
"""
from ringtrain.errors import (RankFailureError, RingtrainError, StallError, TensorMismatchError,  # noqa: F401
                              UnsupportedDtypeError)

from ringtrain.core.observe import dump_flight_recorder, straggler_report  # noqa: F401
from .compression import Compression  # noqa: F401
from .functions import (  # noqa: F401
    Adasum, Average, Max, Min, Product, ProcessSet, ReduceOp, Sum,
    BroadcastGlobalVariablesHook, add_process_set, allgather, allgather_object, allreduce, alltoall, barrier,
    broadcast, broadcast_, broadcast_global_variables, broadcast_object, broadcast_object_fn, broadcast_variables,
    ccl_built, cross_rank, cross_size, cuda_built, ddl_built, global_process_set, gloo_built, gloo_enabled,
    grouped_allgather, grouped_allreduce, grouped_reducescatter, init, is_homogeneous, is_initialized, join,
    local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built,
    rank, reducescatter, remove_process_set, rocm_built, shutdown, size,
    start_timeline, stop_timeline,
)
from .topology_ops import local_rank_op, local_size_op, process_set_included_op, rank_op, size_op  # noqa: F401
from . import elastic  # noqa: F401  -- hvd.elastic
from . import mpi_ops  # noqa: F401  -- horovod.tensorflow.mpi_ops
from .gradient_aggregation import LocalGradientAggregationHelper  # noqa: F401
from .gradient_tape import DistributedGradientTape, PartialDistributedGradientTape  # noqa: F401
from .optimizer import DistributedOptimizer  # noqa: F401
from .sync_batch_norm import SyncBatchNormalization  # noqa: F401
