"""hvd.elastic for TensorFlow 2 (eager), with Horovod's names: run, TensorFlowKerasState, TensorFlowState and
ObjectState.

    import ringtrain.tensorflow as hvd
    hvd.init()
    state = hvd.elastic.TensorFlowState(model.variables, optimizer=optimizer, epoch=0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for batch in batches:
                train_step(batch)           # a tf.function with DistributedGradientTape
            state.commit()                  # where the ranks check for workers added or removed
    train(state)

Lossless mode (the default): after the world changed, sync() hands the live variables and attributes of the rank that
completed the most steps to the rest (a failure costs at most the step in flight). TensorFlowState counts steps with
its optimizer (ringtrain's `optimizer=` keyword: its `iterations`, and its variables travel with the state); without
one every rank counts 0 and sync() takes rank 0's live state, which is a whole state (its variables and attributes
together), only maybe fewer steps along than another survivor's. Roll-back mode (`hvd.elastic.run(rollback=True)`,
Horovod's): commit() keeps a copy of every variable (tf.identity, in memory), restore() assigns them back and sync()
broadcasts rank 0's and commits them. TensorFlow 1 sessions are not supported.
"""
import functools

import tensorflow as tf

from ..core import state as core_state
from ..elastic import runner
from ..elastic.state import ObjectState
from ..errors import HorovodInternalError, UnsupportedOperationError
from .functions import broadcast_variables


def run(func=None, *, rollback=False):
    """hvd.elastic.run for TensorFlow/Keras: a collective that fails inside a traced function (tf.function, fit's
    step) surfaces as a TensorFlow error wrapping ringtrain's; once the world's engine has failed, that is a
    HorovodInternalError (re-form). rollback=True: Horovod's roll-back to the last commit."""
    if func is None:
        return functools.partial(run, rollback=rollback)

    @functools.wraps(func)
    def converting(state, *args, **kwargs):
        try:
            return func(state, *args, **kwargs)
        except tf.errors.OpError as error:
            if core_state.is_initialized() and core_state.engine().failed is not None:
                raise HorovodInternalError(f"a collective failed inside a TensorFlow graph: {error.message}") \
                    from error
            raise
    return runner.run(converting, rollback=rollback)


def _optimizer_variables(optimizer):
    if optimizer is None:
        return []
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


def _optimizer_steps(optimizer):
    """The optimizer's own count of applied steps (0 before it is built)."""
    if optimizer is None or not getattr(optimizer, "built", True):
        return 0
    return int(optimizer.iterations.numpy())


class _VariablesState(ObjectState):
    """ObjectState plus a list of variables (`_variables()`, `_build()` from the subclass): copies for roll-back,
    a broadcast from the source rank for sync."""

    def __init__(self, name, **kwargs):
        self._name = name
        self._saved_variables = None
        super().__init__(**kwargs)
        self._save_variables()

    def _save_variables(self):
        self._saved_variables = [tf.identity(v) for v in self._variables()]

    def save(self):
        self._save_variables()
        super().save()

    def restore(self):
        variables = self._variables()
        if len(variables) != len(self._saved_variables):
            raise RuntimeError(f"{self._name}.restore: the state holds {len(variables)} variables, the commit "
                               f"{len(self._saved_variables)} (was the optimizer built after the commit?)")
        for variable, saved in zip(variables, self._saved_variables):
            variable.assign(saved)
        super().restore()

    def sync_from(self, root):
        self._build()
        broadcast_variables(self._variables(), root_rank=root, prefix=f"elastic.{self._name}")
        super().sync_from(root)

    def sync(self):
        super().sync()
        if self.rollback:
            self.save()


class TensorFlowKerasState(_VariablesState):
    """A Keras model, its optimizer (the model's compiled one unless given) and any other attributes. sync() first
    builds the optimizer where it is not built yet (a worker that just joined has not stepped). `backend` is
    accepted for Horovod compatibility and ignored (TensorFlow 2 only)."""

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        self.model = model
        self.optimizer = optimizer if optimizer is not None else model.optimizer
        super().__init__("keras_state", **kwargs)

    def _variables(self):
        return list(self.model.variables) + _optimizer_variables(self.optimizer)

    def _build(self):
        if self.optimizer is not None and not self.optimizer.built:
            self.optimizer.build(self.model.trainable_variables)

    def steps_completed(self):
        return _optimizer_steps(self.optimizer)


class TensorFlowState(_VariablesState):
    """A list of tf.Variables and any other attributes, in eager TensorFlow 2.

    variables: the tf.Variables to hand over (required: eager TensorFlow 2 has no global variable collection).
    session: Horovod's TensorFlow 1 session; must be None. optimizer (ringtrain's keyword): a Keras optimizer that
    updates these variables; its variables join the state (built for the trainable ones of `variables` where it is
    not built yet) and its `iterations` counts the steps completed, so lossless sync() takes the most advanced rank's
    state. Without it every rank counts 0 steps and sync() takes rank 0's live state (a whole state)."""

    def __init__(self, variables=None, session=None, optimizer=None, **kwargs):
        if session is not None or not tf.executing_eagerly():
            raise UnsupportedOperationError(
                "TensorFlowState supports eager TensorFlow 2 only: a TensorFlow 1 session (session=) or graph mode is "
                "not supported; pass the variables of an eager program")
        if variables is None:
            raise ValueError("TensorFlowState(variables=None): eager TensorFlow 2 has no global variable "
                             "collection; pass the list of tf.Variables to hand over (e.g. model.variables)")
        self.variables = list(variables)
        for i, variable in enumerate(self.variables):
            if not hasattr(variable, "assign"):
                raise TypeError(f"TensorFlowState: variables[{i}] is a {type(variable).__name__}, not a tf.Variable")
        self.session = None
        self.optimizer = optimizer
        super().__init__("tf_state", **kwargs)

    def _variables(self):
        return self.variables + _optimizer_variables(self.optimizer)

    def _build(self):
        if self.optimizer is not None and not getattr(self.optimizer, "built", True):
            self.optimizer.build([v for v in self.variables if v.trainable])

    def steps_completed(self):
        return _optimizer_steps(self.optimizer)


__all__ = ["run", "TensorFlowKerasState", "TensorFlowState", "ObjectState"]
