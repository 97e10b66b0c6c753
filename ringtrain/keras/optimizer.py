"""DistributedOptimizer for Keras 3 (TensorFlow backend): gradients are averaged over all ranks inside model.fit.

    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.001 * hvd.size()))
    model.compile(optimizer=opt, loss=..., metrics=[...])
    model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), ...])

The wrapper only hooks apply() (which Keras's train_step reaches through apply_gradients) and hands the gradients to
ringtrain.tensorflow.gradients' GradientReducer (the shared ringtrain.reducer.reducer underneath): one host call per step
that submits one allreduce per bucket. Nothing here imports MPI or cupy.

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
import dataclasses

import keras
import tensorflow as tf

from ringtrain.core import state as core_state
from ringtrain.errors import RingtrainError, TensorMismatchError
from ringtrain.reducer.model_check import describe_model_mismatch
from ringtrain.reducer.reducer import Scaling, instance_prefix
from ringtrain.tensorflow import functions
from ringtrain.tensorflow.compression import Compression
from ringtrain.tensorflow.functions import Average, variable_name
from ringtrain.tensorflow.gradient_tape import scale_local
from ringtrain.tensorflow.gradients import GradientReducer
from ringtrain.reducer.wrapping import wrapper_class

from . import xla


@dataclasses.dataclass(eq=False)
class _Accumulation:
    """backward_passes_per_step > 1: the local sum of the gradients so far and how many steps it holds. Both are
    optimizer variables (checkpointed and broadcast with the rest of its state), counted inside the traced step,
    where Python -- and so the reducer's own pass counter -- does not run."""
    gradients: list
    passes: object


@dataclasses.dataclass(eq=False)
class _KerasReducer:
    """What the wrapper adds to the user's optimizer, as its one attribute `_ringtrain`."""
    prefix: str
    reducer: GradientReducer
    passes_per_step: int
    average_aggregated: bool
    accumulation: _Accumulation = None
    local: frozenset = frozenset()      # PartialDistributedOptimizer: ids of variables whose gradients stay local
    scale_local: bool = True


class _DistributedOptimizerMixin:
    """Mixed in front of the wrapped optimizer's own class (see DistributedOptimizer)."""

    def build(self, variables):
        variables = list(variables)
        if not core_state.config().elastic:
            # a collective: not in an elastic job, where a worker that joins builds its optimizer in sync() while
            # the others' are built already
            self._rt_check_same_model(variables)
        super().build(variables)
        state = self._ringtrain
        if state.passes_per_step > 1:
            state.accumulation = _Accumulation(
                [self.add_variable_from_reference(v, name="ringtrain_accumulated_gradient") for v in variables],
                self.add_variable(shape=(), dtype="int64", initializer="zeros", name="ringtrain_backward_passes"))

    def _rt_check_same_model(self, variables):
        # position first: two Dense layers both have a 'dense/kernel' once Keras's counters are stripped
        mine = [(f"{variable_name(v)} (#{i})", tuple(v.shape), str(v.dtype)) for i, v in enumerate(variables)]
        state = self._ringtrain
        everyone = functions.allgather_object(mine, name=state.prefix + ".model_check",
                                              process_set=state.reducer.process_set)
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
        if self._ringtrain.passes_per_step == 1:
            return super().apply(self._rt_allreduce(grads, variables), variables)
        return self._rt_accumulate_or_apply(grads, variables)

    def _rt_allreduce(self, grads, variables):
        state = self._ringtrain
        if not state.local:
            return state.reducer(grads, state.prefix)
        is_local = [id(v) in state.local for v in variables]
        shared = [i for i, local in enumerate(is_local) if not local]
        out = list(grads)
        if shared:
            for i, grad in zip(shared, state.reducer([grads[i] for i in shared], state.prefix)):
                out[i] = grad
        return scale_local(out, is_local, state.reducer.process_set.size()) if state.scale_local else out

    def _rt_accumulate_or_apply(self, grads, variables):
        state = self._ringtrain
        accumulators = self._rt_accumulators_for(variables)
        for accumulator, grad in zip(accumulators, grads):
            accumulator.assign_add(tf.convert_to_tensor(grad))
        state.accumulation.passes.assign_add(1)

        def update():
            total = [a.value if hasattr(a, "value") else a.read_value() for a in accumulators]
            if state.average_aggregated:
                total = [t / tf.cast(state.passes_per_step, t.dtype) for t in total]
            super(_DistributedOptimizerMixin, self).apply(self._rt_allreduce(total, variables), variables)
            for accumulator in accumulators:
                accumulator.assign(tf.zeros_like(accumulator))
            return tf.constant(True)

        return tf.cond(state.accumulation.passes % state.passes_per_step == 0, update, lambda: tf.constant(False))

    def _rt_accumulators_for(self, variables):
        gradients = self._ringtrain.accumulation.gradients
        return [gradients[self._get_variable_index(v)] for v in variables]


def DistributedOptimizer(optimizer, name=None, compression=Compression.none, sparse_as_dense=False,
                         backward_passes_per_step=1, average_aggregated_gradients=False, op=Average,
                         gradient_predivide_factor: float = 1.0, bucket_cap_mb: float = 25,
                         process_set=None) -> "tf.keras.optimizers.Optimizer":
    """Return a Keras 3 optimizer of `optimizer`'s own class and configuration whose updates use gradients averaged
    over all ranks. Wrap it before its first step: it is rebuilt from optimizer.get_config(), so state the original
    already holds is not carried over.

    compression: Compression.none | fp16 | bf16 on the wire. op: Average (default), Sum or Adasum (the gradients
    combined by Adasum's rule, ringtrain.core.adasum).
    backward_passes_per_step: apply every k-th step the sum of k steps' gradients (their mean with
    average_aggregated_gradients=True). sparse_as_dense: densify tf.IndexedSlices gradients instead of gathering.
    bucket_cap_mb: gradients are allreduced in buckets of at most this size. process_set: average over that set's
    ranks only (default: all ranks).
    """
    process_set = functions.global_process_set if process_set is None else process_set
    # apply() consumes the averaged gradients within this step: they may stay in the shared buffers
    reducer = GradientReducer(Scaling.for_gradients(op, gradient_predivide_factor), compression, sparse_as_dense,
                              bucket_cap_mb, process_set, results_in_shared_buffers=True)
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    if isinstance(optimizer, _DistributedOptimizerMixin):
        raise ValueError("this optimizer is already a DistributedOptimizer")
    if getattr(optimizer, "built", False) and optimizer.iterations.numpy() > 0:
        raise RingtrainError("DistributedOptimizer must wrap an optimizer that has not taken a step yet "
                             "(it is rebuilt from its config; its state would be lost)")
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    wrapped = wrapper_class(_DistributedOptimizerMixin, optimizer.__class__).from_config(config)
    wrapped._ringtrain = _KerasReducer(instance_prefix("DistributedOptimizer", process_set), reducer,
                                       int(backward_passes_per_step), bool(average_aggregated_gradients))
    return wrapped


def PartialDistributedOptimizer(optimizer, name=None, compression=Compression.none, sparse_as_dense=False,
                                backward_passes_per_step=1, average_aggregated_gradients=False, op=Average,
                                gradient_predivide_factor: float = 1.0, bucket_cap_mb: float = 25, process_set=None,
                                local_layers=None, scale_local_gradients=True):
    """DistributedOptimizer whose gradients of the variables of `local_layers` (a Keras layer or a list of them)
    stay local, not reduced over ranks (Horovod's); with scale_local_gradients (Horovod's default) they are divided
    by the set's size, as the averaged ones are."""
    wrapped = DistributedOptimizer(optimizer, name, compression, sparse_as_dense, backward_passes_per_step,
                                   average_aggregated_gradients, op, gradient_predivide_factor, bucket_cap_mb,
                                   process_set)
    if local_layers is None:
        local_layers = []
    elif not isinstance(local_layers, (list, tuple)):
        local_layers = [local_layers]
    wrapped._ringtrain.local = frozenset(id(v) for layer in local_layers for v in layer.trainable_weights)
    wrapped._ringtrain.scale_local = bool(scale_local_gradients)
    return wrapped


def load_model(filepath: str, custom_optimizers: "list | None" = None, custom_objects: "dict | None" = None,
               compression=Compression.none) -> "keras.Model":
    """Horovod's: load a model saved by Keras (model.save) with its optimizer as a DistributedOptimizer, its state
    (iterations, moments) as saved, so training goes on where it stopped. custom_optimizers: optimizer classes of
    your own used by the saved model; custom_objects: passed to keras.models.load_model."""
    builtin = [cls for cls in vars(keras.optimizers).values()
               if isinstance(cls, type) and issubclass(cls, keras.optimizers.Optimizer)
               and cls is not keras.optimizers.Optimizer]
    # the saved optimizer is rebuilt as a DistributedOptimizer of its own class, so the state Keras loads into it
    # is kept (wrapping after the load would rebuild it from its config and lose it)
    objects = {cls.__name__: _loading_class(cls, compression) for cls in builtin + list(custom_optimizers or [])}
    objects.update(custom_objects or {})
    return keras.models.load_model(filepath, custom_objects=objects)


def _loading_class(cls, compression):
    """cls's DistributedOptimizer class whose instances get their reducer when Keras constructs them."""
    def __init__(self, *args, **kwargs):
        cls.__init__(self, *args, **kwargs)
        process_set = functions.global_process_set
        reducer = GradientReducer(Scaling.for_gradients(Average), compression, False, 25, process_set,
                                  results_in_shared_buffers=True)
        self._ringtrain = _KerasReducer(instance_prefix("DistributedOptimizer", process_set), reducer, 1, False)
    return type(cls.__name__, (wrapper_class(_DistributedOptimizerMixin, cls),), {"__init__": __init__})
