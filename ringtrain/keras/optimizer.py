"""DistributedOptimizer for Keras 3 (TensorFlow backend): gradients are averaged over all ranks inside model.fit.

    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.001 * hvd.size()))
    model.compile(optimizer=opt, loss=..., metrics=[...])
    model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), ...])

The wrapper only hooks apply() (which Keras's train_step reaches through apply_gradients) and hands the gradients to
ringtrain.tensorflow.gradients: one host call per step that submits one grouped allreduce per bucket. Nothing here
imports MPI or cupy.

- backward_passes_per_step=k: k steps add their local gradients into accumulators (optimizer variables, so they
  are saved and broadcast like any other state); every k-th step allreduces the sum (or the mean with
  average_aggregated_gradients=True) and applies it. optimizer.iterations counts applied updates only, so learning
  rate schedules see one step per update (as Horovod).
- A gradient that is None on this step (a variable the loss does not reach) is sent as zeros, so every rank submits
  the same tensors and nothing waits forever.
- At build time, every rank's variable list is compared (one allgather_object): a model that differs across ranks
  raises TensorMismatchError on every rank, naming the variable and the ranks.
- XLA: a host callback cannot run inside an XLA cluster. Inside a jit_compile=True function, apply() raises a clear
  error; ringtrain.keras's callbacks turn XLA off (with a warning) before fit traces its step. See xla.py.
"""
import itertools

import tensorflow as tf

from ringtrain.errors import RingtrainError, TensorMismatchError
from ringtrain.model_check import describe_model_mismatch
from ringtrain.tensorflow import functions
from ringtrain.tensorflow.compression import Compression
from ringtrain.tensorflow.functions import Average, as_op, variable_name
from ringtrain.tensorflow.gradients import allreduce_gradients

from . import xla

_instance_counter = itertools.count()   # names stay distinct when one process wraps several optimizers


class _DistributedOptimizerMixin:
    """Mixed in front of the wrapped optimizer's own class (see DistributedOptimizer)."""

    def _rt_setup(self, compression, sparse_as_dense, backward_passes_per_step, average_aggregated_gradients, op,
                  gradient_predivide_factor, bucket_cap_mb, process_set):
        self._rt_passes_per_step = int(backward_passes_per_step)
        self._rt_average_aggregated = bool(average_aggregated_gradients)
        self._rt_prefix = f"DistributedOptimizer{next(_instance_counter)}"
        self._rt_process_set = process_set
        scales = {}
        if gradient_predivide_factor != 1.0:
            scales = dict(prescale_factor=1.0 / gradient_predivide_factor, postscale_factor=gradient_predivide_factor)
        self._rt_options = dict(compression=compression, op=op, sparse_as_dense=sparse_as_dense,
                                bucket_cap_mb=bucket_cap_mb, process_set=process_set, **scales)

    def build(self, variables):
        variables = list(variables)
        self._rt_check_same_model(variables)
        super().build(variables)
        if self._rt_passes_per_step > 1:
            # optimizer variables: checkpointed and broadcast with the rest of the optimizer's state
            self._rt_accumulators = [self.add_variable_from_reference(v, name="ringtrain_accumulated_gradient")
                                     for v in variables]
            self._rt_passes = self.add_variable(shape=(), dtype="int64", initializer="zeros",
                                                name="ringtrain_backward_passes")

    def _rt_check_same_model(self, variables):
        # position first: two Dense layers both have a 'dense/kernel' once Keras's counters are stripped
        mine = [(f"{variable_name(v)} (#{i})", tuple(v.shape), str(v.dtype)) for i, v in enumerate(variables)]
        everyone = functions.allgather_object(mine, name=self._rt_prefix + ".model_check",
                                              process_set=self._rt_process_set)
        if any(entries != everyone[0] for entries in everyone):
            raise TensorMismatchError(describe_model_mismatch(
                everyone, "DistributedOptimizer", "variable", lambda spec: f"shape {spec[0]} {spec[1]}",
                "Every rank must build the same model (same layers, shapes and order) before training."))

    def apply(self, grads, trainable_variables=None):
        xla.check_not_compiling("DistributedOptimizer.apply")
        grads = list(grads)
        variables = list(trainable_variables) if trainable_variables is not None else self._trainable_variables
        if not self.built:
            with tf.name_scope(self.name):
                self.build(variables)
            self.built = True
        # a variable without a gradient on this rank still takes part, as zeros: every rank submits the same list
        grads = [tf.zeros_like(v) if g is None else g for g, v in zip(grads, variables)]
        if self._rt_passes_per_step == 1:
            return super().apply(self._rt_allreduce(grads, variables), variables)
        return self._rt_accumulate_or_apply(grads, variables)

    def _rt_allreduce(self, grads, variables):
        # apply() consumes the averaged gradients within this step: they may stay in the shared buffers
        return allreduce_gradients(grads, self._rt_prefix, results_in_shared_buffers=True, **self._rt_options)

    def _rt_accumulate_or_apply(self, grads, variables):
        for accumulator, grad, variable in zip(self._rt_accumulators_for(variables), grads, variables):
            accumulator.assign_add(tf.convert_to_tensor(grad))
        self._rt_passes.assign_add(1)

        def update():
            accumulators = self._rt_accumulators_for(variables)
            total = [a.value if hasattr(a, "value") else a.read_value() for a in accumulators]
            if self._rt_average_aggregated:
                total = [t / tf.cast(self._rt_passes_per_step, t.dtype) for t in total]
            super(_DistributedOptimizerMixin, self).apply(self._rt_allreduce(total, variables), variables)
            for accumulator in accumulators:
                accumulator.assign(tf.zeros_like(accumulator))
            return tf.constant(True)

        return tf.cond(self._rt_passes % self._rt_passes_per_step == 0, update, lambda: tf.constant(False))

    def _rt_accumulators_for(self, variables):
        return [self._rt_accumulators[self._get_variable_index(v)] for v in variables]


_wrapper_classes = {}


def DistributedOptimizer(optimizer, name=None, compression=Compression.none, sparse_as_dense=False,
                         backward_passes_per_step=1, average_aggregated_gradients=False, op=Average,
                         gradient_predivide_factor=1.0, bucket_cap_mb=25, process_set=None):
    """Return a Keras 3 optimizer of `optimizer`'s own class and configuration whose updates use gradients averaged
    over all ranks. Wrap it before its first step: it is rebuilt from optimizer.get_config(), so state the original
    already holds is not carried over.

    compression: Compression.none | fp16 | bf16 on the wire. op: Average (default) or Sum.
    backward_passes_per_step: apply every k-th step the sum of k steps' gradients (their mean with
    average_aggregated_gradients=True). sparse_as_dense: densify tf.IndexedSlices gradients instead of gathering.
    bucket_cap_mb: gradients are allreduced in grouped buckets of at most this size. process_set: average over that
    set's ranks only (default: all ranks).
    """
    op = as_op(op)
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor} needs op=Average, got {op.name}")
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    if isinstance(optimizer, _DistributedOptimizerMixin):
        raise ValueError("this optimizer is already a DistributedOptimizer")
    if getattr(optimizer, "built", False) and optimizer.iterations.numpy() > 0:
        raise RingtrainError("DistributedOptimizer must wrap an optimizer that has not taken a step yet "
                             "(it is rebuilt from its config; its state would be lost)")
    base = optimizer.__class__
    cls = _wrapper_classes.get(base)
    if cls is None:
        cls = _wrapper_classes[base] = type(base.__name__, (_DistributedOptimizerMixin, base), {})
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    wrapped = cls.from_config(config)
    wrapped._rt_setup(compression, sparse_as_dense, backward_passes_per_step, average_aggregated_gradients, op,
                      gradient_predivide_factor, bucket_cap_mb,
                      functions.global_process_set if process_set is None else process_set)
    return wrapped
