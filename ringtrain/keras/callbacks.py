"""Keras callbacks for data-parallel fit, with Horovod's names.

    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),      # same start on every rank
                 hvd.callbacks.MetricAverageCallback(),                  # epoch metrics averaged over ranks
                 hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.01 * hvd.size(), warmup_epochs=3,
                                                          steps_per_epoch=steps)]
    model.fit(x, y, callbacks=callbacks, verbose=hvd.verbose())

Every ringtrain callback turns XLA off for the train step before fit traces it (with a warning; see xla.py).
BroadcastGlobalVariablesCallback and MetricAverageCallback take `process_set=` (default: all ranks), as the
collectives do: only the set's ranks pass them to fit, and root_rank is a world rank. A rank outside the set gets
the core's error when it constructs one.
"""
import numpy as np
import keras

from ringtrain.core import collectives
from ringtrain.tensorflow import functions

from . import xla


class _RingtrainCallback(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        xla.turn_off_xla(self.model)


def _checked(process_set):
    """The set (None = all ranks); a set this rank is not in raises now, naming the set, not at fit's first epoch."""
    if process_set is None or process_set is functions.global_process_set:
        return functions.global_process_set
    functions.route(process_set)
    return process_set


class BroadcastGlobalVariablesCallback(_RingtrainCallback):
    """At the start of fit, make every rank's (of `process_set`'s) model and optimizer variables equal root_rank's.
    The optimizer is built first if it is not yet, so its state (Adam's moments, iterations) starts equal too."""

    def __init__(self, root_rank=0, local_variables=None, process_set=None):
        super().__init__()
        self.root_rank = root_rank
        self.local_variables = {id(v) for v in (local_variables or [])}    # Horovod's: not broadcast
        self.process_set = _checked(process_set)

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        optimizer = getattr(self.model, "optimizer", None)
        variables = list(self.model.variables)
        if optimizer is not None:
            if not optimizer.built:
                optimizer.build(self.model.trainable_variables)
            variables += list(optimizer.variables)
        variables = [v for v in variables if id(v) not in self.local_variables]
        functions.broadcast_variables(variables, self.root_rank, prefix="BroadcastGlobalVariablesCallback",
                                      process_set=self.process_set)


class MetricAverageCallback(_RingtrainCallback):
    """At the end of every epoch, replace each numeric metric in `logs` by its mean over all ranks of `process_set`
    (before any later callback such as a checkpoint or a logger reads them: list this one first)."""

    def __init__(self, process_set=None):
        super().__init__()
        self.process_set = _checked(process_set)

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and isinstance(float(v), float))
        values = np.array([float(logs[k]) for k in keys], np.float64)
        averaged = collectives.allreduce(values, op=functions.Average, name=f"MetricAverageCallback.{epoch}.{','.join(keys)}",
                                   process_set=self.process_set)
        for key, value in zip(keys, averaged):
            logs[key] = float(value)


class LearningRateScheduleCallback(_RingtrainCallback):
    """Between start_epoch and end_epoch, set the learning rate to initial_lr * multiplier(epoch).

    multiplier: a number, or a function of the epoch (a float inside the epoch when staircase=False and
    steps_per_epoch is known, so the rate changes every batch)."""

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True, steps_per_epoch=None,
                 verbose=0):
        super().__init__()
        self.initial_lr = float(initial_lr)
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier)
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.staircase = staircase
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self._epoch = 0

    def _active(self, epoch):
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _set(self, epoch):
        lr = self.initial_lr * self.multiplier(epoch)
        self.model.optimizer.learning_rate = lr
        return lr

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        if self._active(epoch):
            lr = self._set(epoch)
            if self.verbose and functions.rank() == 0:
                print(f"\nEpoch {epoch + 1}: learning rate {lr:.6g}")

    def on_train_batch_begin(self, batch, logs=None):
        if self.staircase or not self.steps_per_epoch or not self._active(self._epoch):
            return
        self._set(self._epoch + batch / self.steps_per_epoch)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the learning rate from initial_lr / size() to initial_lr over warmup_epochs (Goyal et al., 2017:
    large effective batches train well when the scaled rate is reached gradually). Per batch when steps_per_epoch
    is given, else per epoch."""

    def __init__(self, initial_lr, warmup_epochs=5, steps_per_epoch=None, verbose=0):
        size = functions.size()

        def multiplier(epoch):
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)
        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=steps_per_epoch is None, steps_per_epoch=steps_per_epoch, verbose=verbose)

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.end_epoch - 1 and self.verbose and functions.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished learning rate warm-up to {self.initial_lr:.6g}")


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Horovod's: a ModelCheckpoint that keeps only the best model by `monitor` (save_best_only=True). As in
    Horovod, `filepath` may be left out and set on the callback (`callback.filepath = ...`) before fit; only rank 0
    writes the file (give it metrics averaged over the ranks, e.g. after MetricAverageCallback, so its choice is
    everyone's)."""

    def __init__(self, monitor="val_loss", verbose=0, save_weights_only=False, mode="auto", save_freq="epoch",
                 filepath=None):
        # Keras checks the suffix at construction: a stand-in of the right kind until the real path is known
        super().__init__(filepath or ("best.weights.h5" if save_weights_only else "best.keras"), monitor=monitor,
                         verbose=verbose, save_best_only=True, save_weights_only=save_weights_only, mode=mode,
                         save_freq=save_freq)
        self.filepath = filepath

    def on_train_begin(self, logs=None):
        if not self.filepath:
            raise ValueError("BestModelCheckpoint has no filepath: pass filepath= or set callback.filepath before fit")
        xla.turn_off_xla(self.model)
        super().on_train_begin(logs)

    def _save_model(self, epoch, batch, logs):
        if functions.rank() == 0:
            super()._save_model(epoch, batch, logs)
