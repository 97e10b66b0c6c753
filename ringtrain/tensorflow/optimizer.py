"""hvd.DistributedOptimizer in ringtrain.tensorflow, as Horovod's TF2 one: a Keras optimizer is handed to the Keras
binding (ringtrain.keras.DistributedOptimizer), so a horovod.tensorflow script that wraps its Keras optimizer runs
with only the import changed.

    import ringtrain.tensorflow as hvd
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()))
    model.compile(optimizer=opt, loss=...)

The Keras binding sits above this one (it builds on it), so it is imported by name, when a Keras optimizer arrives.
TF1 optimizers (tf.compat.v1.train.Optimizer) are not supported: use DistributedGradientTape.
"""
import importlib

import tensorflow as tf

from ringtrain.errors import UnsupportedOperationError

from .compression import Compression
from .functions import Average, global_process_set


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense="", device_sparse="",
                         compression=Compression.none, sparse_as_dense=False, backward_passes_per_step=1,
                         op=Average, gradient_predivide_factor=1.0, average_aggregated_gradients=False,
                         num_groups=0, groups=None, process_set=global_process_set,
                         bucket_cap_mb: float = 25) -> "tf.keras.optimizers.Optimizer":
    """Wrap a Keras optimizer so that its updates use gradients averaged over the ranks (see
    ringtrain.keras.DistributedOptimizer). use_locking, device_dense and device_sparse are accepted for Horovod
    compatibility and ignored; num_groups / groups are not supported (buckets are laid out by size)."""
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        raise UnsupportedOperationError(
            "DistributedOptimizer of a TF1 tf.compat.v1.train.Optimizer is not supported; compute gradients with "
            "hvd.DistributedGradientTape(tape) and apply them with the optimizer, or use a Keras optimizer")
    if num_groups or groups is not None:
        raise UnsupportedOperationError("DistributedOptimizer(num_groups=, groups=) is not supported for Keras "
                                        "optimizers: gradients go in buckets of up to bucket_cap_mb")
    keras_binding = importlib.import_module("ringtrain.keras")
    return keras_binding.DistributedOptimizer(
        optimizer, name=name, compression=compression, sparse_as_dense=sparse_as_dense,
        backward_passes_per_step=backward_passes_per_step, average_aggregated_gradients=average_aggregated_gradients,
        op=op, gradient_predivide_factor=gradient_predivide_factor, bucket_cap_mb=bucket_cap_mb,
        process_set=process_set)
