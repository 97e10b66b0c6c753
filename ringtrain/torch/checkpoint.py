"""Atomic checkpoints written by rank 0 and restored on every rank.

    hvd.save_checkpoint("ckpt.pt", model, optimizer, epoch=epoch, step=step)      # every rank calls it
    extra = hvd.load_checkpoint("ckpt.pt", model, optimizer)                      # -> {"epoch": ..., "step": ...}

save_checkpoint: rank 0 writes a temporary file in the same directory, flushes and fsyncs it, renames it over
`path` (os.replace is atomic on POSIX) and fsyncs the directory, so a crash at any moment leaves either the old
checkpoint or the new one, never a torn file. The other ranks learn whether the write succeeded (a small
broadcast), so a full disk raises on every rank rather than only on rank 0.

load_checkpoint: rank 0 reads the file with torch.load(weights_only=True) -- no arbitrary unpickling, so a
checkpoint from an untrusted source cannot run code -- and broadcasts parameters, buffers, optimizer state and the
extra values to every rank. Without ringtrain.init() both work as plain single-process save/load.
"""
import os
import tempfile

import torch

from ringtrain.errors import RingtrainError

from . import functions
from .broadcast import broadcast_optimizer_state, broadcast_parameters

__all__ = ["save_checkpoint", "load_checkpoint", "CheckpointError"]

FORMAT = "ringtrain.checkpoint/1"
# what torch.load(weights_only=True) can read back: so `extra` is checked when saving, not when it is too late
_PLAIN = (bool, int, float, str, bytes, type(None), torch.Tensor, torch.dtype, torch.device, torch.Size)


class CheckpointError(RingtrainError):
    """Saving or loading a checkpoint failed on rank 0; raised on every rank."""


def _rank():
    return functions.rank() if functions.is_initialized() else 0


def _distributed():
    return functions.is_initialized() and functions.size() > 1


def _check_plain(value, where):
    if isinstance(value, dict):
        for key, item in value.items():
            _check_plain(key, f"{where} key")
            _check_plain(item, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_plain(item, f"{where}[{i}]")
    elif not isinstance(value, _PLAIN):
        raise TypeError(f"save_checkpoint: {where} is a {type(value).__name__}; checkpoints are loaded with "
                        f"torch.load(weights_only=True), so extra values must be tensors, numbers, strings, "
                        f"None, or lists/tuples/dicts of them")


def _is_sharded(optimizer):
    """DistributedOptimizer(..., shard=...): its state is spread over the ranks, so saving and loading it are
    collective (consolidate on rank 0, scatter from rank 0)."""
    return hasattr(optimizer, "scatter_state_dict")


def _fsync_directory(directory):
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomically(path, payload):
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())      # the data is on disk before the name points at it
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_directory(directory)       # and the rename itself survives a power cut


def _agree(error_text, action, path):
    """Every rank learns rank 0's outcome; all raise together if it failed."""
    if _distributed():
        error_text = functions.broadcast_object(error_text, root_rank=0, name=f"ringtrain.checkpoint.{action}")
    if error_text is not None:
        raise CheckpointError(f"{action} of checkpoint {path!r} failed on rank 0: {error_text}")


def save_checkpoint(path: str, model: torch.nn.Module, optimizer: "torch.optim.Optimizer | None" = None,
                    **extra) -> str:
    """Write model (and optimizer) state plus `extra` keyword values to `path`, atomically, from rank 0 only.
    Every rank must call it (it is collective); returns `path` once the file is durably in place."""
    _check_plain(extra, "extra")
    error_text = None
    if _is_sharded(optimizer):
        optimizer.consolidate_state_dict(to=0)     # collective: the whole state on rank 0 for its state_dict()
    if _rank() == 0:
        payload = {"format": FORMAT, "model": model.state_dict(),
                   "optimizer": optimizer.state_dict() if optimizer is not None else None, "extra": extra}
        try:
            _write_atomically(os.fspath(path), payload)
        except Exception as error:
            if not _distributed():
                raise
            error_text = f"{type(error).__name__}: {error}"
    _agree(error_text, "save", path)
    return path


def load_checkpoint(path: str, model: torch.nn.Module, optimizer: "torch.optim.Optimizer | None" = None) -> dict:
    """Restore model (and optimizer) on every rank from `path` as read by rank 0; returns the `extra` dict.
    Every rank must call it (it is collective)."""
    error_text, extra = None, None
    if _rank() == 0:
        try:
            payload = torch.load(os.fspath(path), map_location="cpu", weights_only=True)
            if not isinstance(payload, dict) or payload.get("format") != FORMAT:
                raise ValueError(f"not a ringtrain checkpoint (format {payload.get('format') if isinstance(payload, dict) else type(payload).__name__!r})")
            model.load_state_dict(payload["model"])
            if optimizer is not None:
                if payload["optimizer"] is None:
                    raise ValueError("the checkpoint has no optimizer state, but an optimizer was passed")
                if not _is_sharded(optimizer):
                    optimizer.load_state_dict(payload["optimizer"])
            extra = payload["extra"]
        except Exception as error:
            if not _distributed():
                raise
            error_text = f"{type(error).__name__}: {error}"
    _agree(error_text, "load", path)
    if _is_sharded(optimizer):       # each rank keeps its slices of rank 0's state
        optimizer.scatter_state_dict(payload["optimizer"] if _rank() == 0 else None, root_rank=0)
    if _distributed():
        broadcast_parameters(model.state_dict(), root_rank=0, prefix="ringtrain.checkpoint.model")
        if optimizer is not None and not _is_sharded(optimizer):
            broadcast_optimizer_state(optimizer, root_rank=0)
        extra = functions.broadcast_object(extra, root_rank=0, name="ringtrain.checkpoint.extra")
    return extra
