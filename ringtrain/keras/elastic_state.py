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
from .callbacks import _RingtrainCallback
from ..tensorflow.elastic import TensorFlowKerasState, run  # noqa: F401  -- Horovod's keras.elastic names


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
