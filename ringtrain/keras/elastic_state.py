"""Elastic state and callbacks for Keras 3 (TensorFlow backend), with Horovod's names.

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    callbacks = [hvd.elastic.CommitStateCallback(state, batches_per_commit=10),
                 hvd.elastic.UpdateBatchStateCallback(state), hvd.elastic.UpdateEpochStateCallback(state)]

    @hvd.elastic.run
    def train(state):
        model.fit(dataset, steps_per_epoch=steps, initial_epoch=state.epoch, epochs=epochs, callbacks=callbacks)

Lossless mode (the default): sync() hands over the model and optimizer variables and the other attributes of the
rank whose optimizer applied the most steps (its `iterations`), so a failure costs at most the batch in flight;
commit() copies nothing and is where the ranks check for workers that joined (CommitStateCallback). Roll-back mode
(`hvd.elastic.run(rollback=True)`, Horovod's): commit() keeps a copy of every model and optimizer variable
(tf.identity, in memory); restore() assigns them back; sync() broadcasts rank 0's and commits. Either way sync()
first builds the optimizer where it is not built yet (a worker that just joined has not stepped).
"""
import functools

import tensorflow as tf

from ..core import state as core_state
from .callbacks import _RingtrainCallback
from ..tensorflow.functions import broadcast_variables
from ..elastic import runner
from ..errors import HorovodInternalError
from ..elastic.state import ObjectState


def run(func=None, *, rollback=False):
    """hvd.elastic.run for TensorFlow/Keras: a collective that fails inside fit's traced step surfaces as a TensorFlow
    error wrapping ringtrain's; once the world's engine has failed, that is a HorovodInternalError (re-form)."""
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


class TensorFlowKerasState(ObjectState):
    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        self.model = model
        self.optimizer = optimizer if optimizer is not None else model.optimizer
        self._saved_variables = None
        super().__init__(**kwargs)
        self._save_variables()

    def _variables(self):
        optimizer = list(self.optimizer.variables) if self.optimizer is not None else []
        return list(self.model.variables) + optimizer

    def _save_variables(self):
        self._saved_variables = [tf.identity(v) for v in self._variables()]

    def save(self):
        self._save_variables()
        super().save()

    def restore(self):
        variables = self._variables()
        if len(variables) != len(self._saved_variables):
            raise RuntimeError(f"KerasState.restore: the model and optimizer hold {len(variables)} variables, the "
                               f"commit {len(self._saved_variables)} (was the optimizer built after the commit?)")
        for variable, saved in zip(variables, self._saved_variables):
            variable.assign(saved)
        super().restore()

    def steps_completed(self):
        """The optimizer's own count of applied steps (0 before it is built)."""
        if self.optimizer is None or not self.optimizer.built:
            return 0
        return int(self.optimizer.iterations.numpy())

    def sync_from(self, root):
        if self.optimizer is not None and not self.optimizer.built:
            self.optimizer.build(self.model.trainable_variables)
        broadcast_variables(self._variables(), root_rank=root, prefix="elastic.keras_state")
        super().sync_from(root)

    def sync(self):
        super().sync()
        if self.rollback:
            self.save()


KerasState = TensorFlowKerasState


class CommitStateCallback(_RingtrainCallback):
    """state.commit() every `batches_per_commit` batches (and so check_host_updates()).

    The count of batches since the last commit goes back with the state: whenever the world changes it starts
    again from a full period, on every rank. The survivors of a failed world stopped at different points (one in
    the last batch's allreduce, another after that batch or inside the commit), so the counts they held differ;
    kept, they would commit at different batches of the next world, where one rank's commit (a collective) would
    meet the other's gradient allreduce."""

    def __init__(self, state, batches_per_commit=1):
        super().__init__()
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit
        state.register_reset_callbacks([self._restart_count])

    def _restart_count(self):
        self.batches_remaining = self.batches_per_commit

    def on_batch_end(self, batch, logs=None):
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit


class UpdateBatchStateCallback(_RingtrainCallback):
    """state.batch follows fit's batch within the epoch (0 again at the epoch's end)."""

    def __init__(self, state):
        super().__init__()
        self.state = state

    def on_batch_end(self, batch, logs=None):
        self.state.batch = batch + 1

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(_RingtrainCallback):
    """state.epoch is the next epoch to run (fit's epoch + 1 at each epoch's end): resume with
    fit(initial_epoch=state.epoch, ...)."""

    def __init__(self, state):
        super().__init__()
        self.state = state

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = epoch + 1


__all__ = ["run", "TensorFlowKerasState", "KerasState", "CommitStateCallback", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback"]
