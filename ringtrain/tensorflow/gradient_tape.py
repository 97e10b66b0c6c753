"""DistributedGradientTape: tape.gradient() returns gradients averaged over all ranks (Horovod's name and rules).

    with tf.GradientTape() as tape:
        loss = loss_fn(model(x), y)
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)      # averaged over ranks; eager or inside tf.function

The wrapper is an instance of the tape's own class with the same recorded state; only gradient() is different.
"""
import zlib

import tensorflow as tf

from ringtrain.reducer.reducer import Scaling
from ringtrain.reducer.wrapping import adopt, wrapper_class

from .compression import Compression
from .functions import Average, global_process_set
from .gradients import GradientReducer


class _DistributedGradientTapeMixin:
    """Its one attribute on the user's tape is `_ringtrain`, the GradientReducer."""

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads)
        reduced = self._ringtrain(flat_grads, _bucket_prefix(flat_sources))
        return tf.nest.pack_sequence_as(grads, reduced)


def _bucket_prefix(sources):
    """Same on every rank for the same sources, and different for source lists of other shapes (a tape for the
    generator and one for the discriminator get their own request names). Shapes only: names of Keras variables
    carry per-process counters."""
    spec = ";".join(f"{tuple(s.shape)}{tf.as_dtype(s.dtype).name}" for s in sources)
    return f"DistributedGradientTape.{len(sources)}.{zlib.crc32(spec.encode()):08x}"


def DistributedGradientTape(gradtape, device_dense="", device_sparse="", compression=Compression.none,
                            sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0, bucket_cap_mb=25,
                            process_set=global_process_set) -> tf.GradientTape:
    """Wrap a tf.GradientTape so that gradient() averages over ranks (op=Average, or Sum).

    compression: Compression.none | fp16 | bf16 on the wire. sparse_as_dense: densify tf.IndexedSlices gradients
    (embeddings) instead of gathering them. gradient_predivide_factor f: divide by f before the sum and by size/f
    after (keeps fp16 sums in range). process_set: average over that set's ranks only (each set's members wrap
    their own tape). device_dense / device_sparse: accepted for Horovod compatibility, ignored.
    """
    reducer = GradientReducer(Scaling.for_gradients(op, gradient_predivide_factor), compression, sparse_as_dense,
                              bucket_cap_mb, process_set)
    wrapped = adopt(wrapper_class(_DistributedGradientTapeMixin, gradtape.__class__), gradtape)
    wrapped._ringtrain = reducer
    return wrapped
