"""Rank 0 writes and prints; the other ranks stay quiet by default.

    model.fit(x, y, verbose=hvd.verbose(), callbacks=callbacks + hvd.rank_zero_only(
        keras.callbacks.ModelCheckpoint("ckpt-{epoch}.keras"), keras.callbacks.CSVLogger("log.csv")))
    hvd.print0("accuracy", acc)

Every rank holds the same weights after each step, so one writer is enough, and N ranks writing the same file would
race. Checkpoints are then loaded on rank 0 and broadcast (BroadcastGlobalVariablesCallback) or loaded on every rank
from a shared file system.
"""
from ringtrain.tensorflow import functions


def _rank():
    return functions.rank() if functions.is_initialized() else 0


def rank_zero_only(*callbacks) -> list:
    """The callbacks on rank 0, [] elsewhere (checkpoints, CSV/TensorBoard loggers, progress printers)."""
    return list(callbacks) if _rank() == 0 else []


def verbose(default: "int | str" = "auto") -> "int | str":
    """fit()/evaluate() verbosity: `default` on rank 0, 0 (silent) on the others."""
    return default if _rank() == 0 else 0


def print0(*args, **kwargs) -> None:
    """print() on rank 0 only."""
    if _rank() == 0:
        print(*args, **kwargs)
