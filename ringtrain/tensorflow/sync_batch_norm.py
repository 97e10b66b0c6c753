"""SyncBatchNormalization: Keras batch normalization whose training statistics are those of the whole batch across
the ranks (Horovod's hvd.SyncBatchNormalization, as torch's SyncBatchNorm).

    x = hvd.SyncBatchNormalization()(x, training=True)

In training, each rank sums its inputs, their squares and its count per channel; one Sum allreduce of the three
gives every rank the global mean and (biased) variance, so ranks with different batch sizes weigh by their rows.
The allreduce is differentiable (its gradient is the Sum allreduce of the gradients), so the input gradients are
those of the global batch. Inference, and a world of one rank, is Keras's own layer.
"""
import keras
import tensorflow as tf

from . import functions


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """keras.layers.BatchNormalization with the batch statistics reduced over the ranks of `process_set` (default:
    all ranks) in training. Every rank must call it in the same steps (it is a collective)."""

    def __init__(self, *args, process_set=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._process_set = functions.global_process_set if process_set is None else process_set

    def _moments(self, inputs, mask):
        if self._process_set.size() == 1:
            return super()._moments(inputs, mask)
        axes = list(self._reduction_axes)
        if mask is None:
            local = [tf.reduce_sum(inputs, axes), tf.reduce_sum(tf.square(inputs), axes),
                     tf.cast(tf.reduce_prod(tf.gather(tf.shape(inputs), axes)), inputs.dtype)]
        else:
            weights = tf.broadcast_to(tf.cast(tf.expand_dims(mask, -1), inputs.dtype), tf.shape(inputs))
            local = [tf.reduce_sum(inputs * weights, axes), tf.reduce_sum(tf.square(inputs) * weights, axes),
                     tf.reduce_sum(weights, axes)]
        total, squares, count = functions.grouped_allreduce(local, op=functions.Sum, process_set=self._process_set)
        mean = total / count
        return mean, tf.maximum(squares / count - tf.square(mean), 0.0)
