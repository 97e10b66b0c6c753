"""DistributedGradientTape: tape.gradient() returns gradients averaged over all ranks (Horovod's name and rules).

    with tf.GradientTape() as tape:
        loss = loss_fn(model(x), y)
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)      # averaged over ranks; eager or inside tf.function

The wrapper is an instance of the tape's own class with the same recorded state; only gradient() is different.
"""
import zlib

import tensorflow as tf

from .compression import Compression
from .functions import Average, as_op, global_process_set
from .gradients import allreduce_gradients


class _DistributedGradientTapeMixin:
    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads)
        reduced = allreduce_gradients(flat_grads, _bucket_prefix(flat_sources), **self._rt_options)
        return tf.nest.pack_sequence_as(grads, reduced)


def _bucket_prefix(sources):
    """Same on every rank for the same sources, and different for source lists of other shapes (a tape for the
    generator and one for the discriminator get their own request names). Shapes only: names of Keras variables
    carry per-process counters."""
    spec = ";".join(f"{tuple(s.shape)}{tf.as_dtype(s.dtype).name}" for s in sources)
    return f"DistributedGradientTape.{len(sources)}.{zlib.crc32(spec.encode()):08x}"


_wrapper_classes = {}


def DistributedGradientTape(gradtape, device_dense="", device_sparse="", compression=Compression.none,
                            sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0, bucket_cap_mb=25,
                            process_set=global_process_set):
    """Wrap a tf.GradientTape so that gradient() averages over ranks (op=Average, or Sum).

    compression: Compression.none | fp16 | bf16 on the wire. sparse_as_dense: densify tf.IndexedSlices gradients
    (embeddings) instead of gathering them. gradient_predivide_factor f: divide by f before the sum and by size/f
    after (keeps fp16 sums in range). process_set: average over that set's ranks only (each set's members wrap
    their own tape). device_dense / device_sparse: accepted for Horovod compatibility, ignored.
    """
    op = as_op(op)
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor} needs op=Average, got {op.name}")
    base = gradtape.__class__
    cls = _wrapper_classes.get(base)
    if cls is None:
        cls = _wrapper_classes[base] = type(base.__name__, (_DistributedGradientTapeMixin, base), {})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(gradtape.__dict__)
    scales = {}
    if gradient_predivide_factor != 1.0:
        scales = dict(prescale_factor=1.0 / gradient_predivide_factor, postscale_factor=gradient_predivide_factor)
    wrapped._rt_options = dict(compression=compression, op=op, sparse_as_dense=sparse_as_dense,
                               bucket_cap_mb=bucket_cap_mb, process_set=process_set, **scales)
    return wrapped
