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
        local = getattr(self, "_ringtrain_local", set())
        shared = [i for i, s in enumerate(flat_sources) if _source_key(s) not in local]
        reduced = list(flat_grads)
        if shared:
            averaged = self._ringtrain([flat_grads[i] for i in shared],
                                       _bucket_prefix([flat_sources[i] for i in shared]))
            for i, grad in zip(shared, averaged):
                reduced[i] = grad
        if local and getattr(self, "_ringtrain_scale_local", True):
            reduced = scale_local(reduced, [_source_key(s) in local for s in flat_sources],
                                  self._ringtrain.process_set.size())
        return tf.nest.pack_sequence_as(grads, reduced)

    def register_local_source(self, source):
        """Keep `source`'s gradient local (not averaged over ranks): Horovod's PartialDistributedGradientTape."""
        if not hasattr(self, "_ringtrain_local"):
            self._ringtrain_local = set()
        self._ringtrain_local.add(_source_key(source))


def scale_local(grads, is_local, set_size):
    """Horovod's scale_local_gradients: local gradients divided by the set's size, like the averaged ones."""
    return [g / tf.cast(set_size, g.dtype) if local and g is not None and not isinstance(g, tf.IndexedSlices)
            else g for g, local in zip(grads, is_local)]


def _source_key(source):
    """Variables compare by value in TF: identify them by the object."""
    return id(source)


def _bucket_prefix(sources):
    """Same on every rank for the same sources, and different for source lists of other shapes (a tape for the
    generator and one for the discriminator get their own request names). Shapes only: names of Keras variables
    carry per-process counters."""
    spec = ";".join(f"{tuple(s.shape)}{tf.as_dtype(s.dtype).name}" for s in sources)
    return f"DistributedGradientTape.{len(sources)}.{zlib.crc32(spec.encode()):08x}"


def DistributedGradientTape(gradtape, device_dense="", device_sparse="", compression=Compression.none,
                            sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0, bucket_cap_mb=25,
                            process_set=global_process_set) -> tf.GradientTape:
    """Wrap a tf.GradientTape so that gradient() averages over ranks (op=Average; or Sum, or Adasum: the gradients
    combined by Adasum's rule, ringtrain.core.adasum).

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


def PartialDistributedGradientTape(gradtape, device_dense="", device_sparse="", compression=Compression.none,
                                   sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0,
                                   bucket_cap_mb=25, process_set=global_process_set, local_layers=None,
                                   scale_local_gradients: bool = True) -> tf.GradientTape:
    """DistributedGradientTape whose gradients of the variables of `local_layers` (a Keras layer or a list of
    them) stay local, not reduced over ranks (as Horovod's: e.g. a per-rank embedding); with scale_local_gradients
    (Horovod's default) they are divided by the set's size, as the averaged ones are. More can be added with
    tape.register_local_source(variable)."""
    wrapped = DistributedGradientTape(gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
                                      gradient_predivide_factor, bucket_cap_mb, process_set)
    wrapped._ringtrain_scale_local = bool(scale_local_gradients)
    if local_layers is None:
        local_layers = []
    elif not isinstance(local_layers, (list, tuple)):
        local_layers = [local_layers]
    for layer in local_layers:
        for variable in layer.trainable_weights:
            wrapped.register_local_source(variable)
    return wrapped
