"""The core API on numpy (and cupy) arrays: validate on the caller's thread, queue to the engine, return a Handle.

Bad input raises here, synchronously and on the rank that made the mistake, before anything reaches the other ranks,
so the job stays usable. Disagreements between ranks are found by the engine and come out of handle.wait().
"""
import collections
import pickle
import threading

import numpy as np

from . import state
from .request import Request
from .errors import RingtrainError
from .handle import GroupHandle, Handle
from .negotiation import Meta
from .ops import Average, as_op, check_op_dtype, dtype_name

_counters = collections.Counter()
_counter_lock = threading.Lock()


def _auto_name(kind, name):
    """Deterministic across ranks as long as every rank makes the same calls in the same order."""
    if name is not None:
        if not isinstance(name, str) or not name:
            raise TypeError(f"name must be a non-empty str, got {name!r}")
        return name
    with _counter_lock:
        _counters[kind] += 1
        return f"{kind}.noname.{_counters[kind]}"


def _reset_names():
    with _counter_lock:
        _counters.clear()


def _device_of(array):
    """'cpu' for numpy, 'cuda' for cupy-like arrays; anything else is a TypeError naming what was passed."""
    if isinstance(array, np.ndarray):
        return "cpu"
    if hasattr(array, "__cuda_array_interface__"):
        return "cuda"
    raise TypeError(f"expected a numpy or cupy array, got {type(array).__module__}.{type(array).__name__}; "
                    "torch tensors go through ringtrain.torch")


def _check_array(array, what):
    device = _device_of(array)
    if not array.flags.c_contiguous:
        raise ValueError(f"{what}: array of shape {array.shape} is not C-contiguous; pass np.ascontiguousarray(x)")
    return device


def _ops(device):
    return state.engine().host_ops if device == "cpu" else _gpu_ops()


def _gpu_ops():
    from . import gpu
    return gpu.device_ops()


def _submit(kind, array, name, op=-1, root=-1, scales=(1.0, 1.0), splits=(), out=None, op_obj=None):
    eng = state.engine()
    name = _auto_name(kind, name)
    device = _check_array(array, f"{kind} {name!r}")
    dt = dtype_name(array.dtype) if op_obj is None else check_op_dtype(op_obj, array.dtype)
    meta = Meta(kind=kind, dtype=dt, shape=tuple(array.shape), op=int(op), root=root, device=device,
                scales=tuple(float(s) for s in scales), splits=tuple(splits))
    ops = _ops(device)
    handle = Handle([name])
    eng.submit(Request(name, meta, array, out, handle, ops, ops.ready_event()))
    return handle


# ------------------------------------------------------------------------------------------------ allreduce
def allreduce_async(array, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0, out=None):
    """Reduce `array` over all ranks. `out=array` reduces in place. Average divides by size() (integers: floor)."""
    op = as_op(op)
    if out is None:
        out = _ops(_device_of(array)).empty(array.shape, array.dtype)
    elif out.shape != array.shape or out.dtype != array.dtype:
        raise ValueError(f"allreduce out has shape {out.shape} {out.dtype}, input {array.shape} {array.dtype}")
    return _submit("allreduce", array, name, op=op, scales=(prescale_factor, postscale_factor), out=out, op_obj=op)


def allreduce(array, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0):
    return allreduce_async(array, op, name, prescale_factor, postscale_factor).wait()


def grouped_allreduce_async(arrays, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0, outs=None):
    """One handle for many tensors; they are negotiated and fused together. wait() returns the list."""
    arrays = list(arrays)
    if not arrays:
        raise ValueError("grouped_allreduce needs at least one array")
    base = _auto_name("grouped_allreduce", name)
    outs = list(outs) if outs is not None else [None] * len(arrays)
    if len(outs) != len(arrays):
        raise ValueError(f"grouped_allreduce got {len(arrays)} arrays but {len(outs)} outs")
    parts = [allreduce_async(a, op, f"{base}.{i}", prescale_factor, postscale_factor, o)
             for i, (a, o) in enumerate(zip(arrays, outs))]
    return GroupHandle(parts)


def grouped_allreduce(arrays, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0):
    return grouped_allreduce_async(arrays, op, name, prescale_factor, postscale_factor).wait()


# ------------------------------------------------------------------------------------------------ others
def allgather_async(array, name=None):
    """Concatenate every rank's array along dim 0 (dim 0 may differ per rank; the rest must match)."""
    if np.ndim(array) == 0:
        raise ValueError("allgather needs an array with at least one dimension")
    return _submit("allgather", array, name)


def allgather(array, name=None):
    return allgather_async(array, name).wait()


def _check_root(root_rank, what):
    if not isinstance(root_rank, (int, np.integer)) or isinstance(root_rank, bool):
        raise TypeError(f"{what}: root_rank must be an int, got {root_rank!r}")
    if not 0 <= root_rank < state.size():
        raise ValueError(f"{what}: root_rank {root_rank} is out of range for {state.size()} ranks")
    return int(root_rank)


def broadcast_async(array, root_rank=0, name=None, out=None):
    """Every rank gets root_rank's array. `out=array` broadcasts in place."""
    root = _check_root(root_rank, "broadcast")
    device = _check_array(array, "broadcast")
    if out is None:
        out = _ops(device).copy(array)
    elif out is not array:
        out[...] = array
    return _submit("broadcast", array, name, root=root, out=out)


def broadcast(array, root_rank=0, name=None):
    return broadcast_async(array, root_rank, name).wait()


def alltoall_async(array, splits=None, name=None):
    """Send rows splits[j] of `array` (in order) to rank j; wait() returns (received array, received splits)."""
    if np.ndim(array) == 0:
        raise ValueError("alltoall needs an array with at least one dimension")
    n = state.size()
    if splits is None:
        if array.shape[0] % n:
            raise ValueError(f"alltoall without splits needs dim 0 ({array.shape[0]}) divisible by size ({n})")
        splits = [array.shape[0] // n] * n
    splits = [int(s) for s in np.asarray(splits).reshape(-1)]
    if len(splits) != n or any(s < 0 for s in splits) or sum(splits) != array.shape[0]:
        raise ValueError(f"alltoall splits {splits} must have {n} non-negative entries summing to dim 0 "
                         f"({array.shape[0]})")
    return _submit("alltoall", array, name, splits=splits)


def alltoall(array, splits=None, name=None):
    return alltoall_async(array, splits, name).wait()


def reducescatter_async(array, op=Average, name=None):
    """Reduce over ranks, then keep this rank's block of dim 0 (split as evenly as possible, first blocks larger)."""
    op = as_op(op)
    if np.ndim(array) == 0:
        raise ValueError("reducescatter needs an array with at least one dimension")
    return _submit("reducescatter", array, name, op=op, op_obj=op)


def reducescatter(array, op=Average, name=None):
    return reducescatter_async(array, op, name).wait()


def barrier(name=None):
    """Returns once every rank has called barrier()."""
    _submit("barrier", np.zeros(0, np.uint8), name).wait()


# ------------------------------------------------------------------------------------------------ objects
def broadcast_object(obj, root_rank=0, name=None):
    """root's object on every rank, by pickle. Unpickling runs code from the root: trusted peers only."""
    root = _check_root(root_rank, "broadcast_object")
    base = _auto_name("broadcast_object", name)
    payload = np.frombuffer(pickle.dumps(obj), np.uint8) if state.rank() == root else np.zeros(0, np.uint8)
    length = broadcast(np.array([payload.size], np.int64), root, f"{base}.len")
    data = payload.copy() if state.rank() == root else np.empty(int(length[0]), np.uint8)
    data = broadcast_async(data, root, f"{base}.data", out=data).wait()
    return obj if state.rank() == root else pickle.loads(data.tobytes())


def allgather_object(obj, name=None):
    """List of every rank's object (pickled; trusted peers only)."""
    base = _auto_name("allgather_object", name)
    payload = np.frombuffer(pickle.dumps(obj), np.uint8)
    lengths = allgather(np.array([payload.size], np.int64), f"{base}.len")
    data = allgather(payload, f"{base}.data")
    out, start = [], 0
    for n in lengths:
        out.append(pickle.loads(data[start:start + int(n)].tobytes()))
        start += int(n)
    return out


def join():
    """This rank has no more data. Until every rank has joined, it takes part in the others' allreduces with zeros
    (Average still divides by size()). Returns the rank that joined last."""
    eng = state.engine()
    handle = Handle(["join"])
    eng.join(handle)
    return handle.wait()


def synchronize(handle):
    return handle.wait()


def poll(handle):
    return handle.poll()


__all__ = ["allreduce", "allreduce_async", "grouped_allreduce", "grouped_allreduce_async", "allgather",
           "allgather_async", "broadcast", "broadcast_async", "alltoall", "alltoall_async", "reducescatter",
           "reducescatter_async", "barrier", "broadcast_object", "allgather_object", "join", "synchronize", "poll",
           "RingtrainError"]
