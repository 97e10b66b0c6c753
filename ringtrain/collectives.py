"""The core API on numpy (and cupy) arrays: validate on the caller's thread, queue to the engine, return a Handle.

Bad input raises here, synchronously and on the rank that made the mistake, before anything reaches the other ranks,
so the job stays usable. Disagreements between ranks are found by the engine and come out of handle.wait().
"""
import pickle

import numpy as np

from . import state
from .errors import RingtrainError
from .fusion import ops_for
from .handle import Handle
from .names import auto_name as _auto_name
from .negotiation import Meta
from .ops import Average, as_op, check_op_dtype, dtype_name
from .request import Request


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


_metas = {}         # the fields of a Meta -> the Meta: a training loop builds the same few thousand again and again


def _meta(kind, dtype, shape, op, root, device, scales, splits):
    key = (kind, dtype, shape, op, root, device, scales, splits)
    meta = _metas.get(key)
    if meta is None:
        if len(_metas) > 65536:
            _metas.clear()
        meta = _metas[key] = Meta(kind=kind, dtype=dtype, shape=shape, op=op, root=root, device=device,
                                  scales=scales, splits=splits)
    return meta


def _submit(kind, array, name, op=-1, root=-1, scales=(1.0, 1.0), splits=(), out=None, op_obj=None, sync=False):
    eng = state.engine()
    name = _auto_name(kind, name)
    device = _check_array(array, f"{kind} {name!r}")
    dt = dtype_name(array.dtype) if op_obj is None else check_op_dtype(op_obj, array.dtype)
    meta = _meta(kind, dt, array.shape, int(op), root, device, (float(scales[0]), float(scales[1])), tuple(splits))
    ops = ops_for(device)
    handle = Handle((name,), eng.drive)
    eng.submit(Request(name, meta, (array,), (out,), handle, ops, ops.ready_event()), wake=not sync)
    return handle


# ------------------------------------------------------------------------------------------------ allreduce
def allreduce_async(array, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0, out=None):
    """Reduce `array` over all ranks. `out=array` reduces in place. Average divides by size() (integers: floor)."""
    return _allreduce(array, op, name, prescale_factor, postscale_factor, out, sync=False)


def allreduce(array, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0, out=None):
    return _allreduce(array, op, name, prescale_factor, postscale_factor, out, sync=True).wait()


def _allreduce(array, op, name, prescale_factor, postscale_factor, out, sync):
    op = as_op(op)
    if out is None:
        out = ops_for(_device_of(array)).empty(array.shape, array.dtype)
    elif out.shape != array.shape or out.dtype != array.dtype:
        raise ValueError(f"allreduce out has shape {out.shape} {out.dtype}, input {array.shape} {array.dtype}")
    return _submit("allreduce", array, name, op=op, scales=(prescale_factor, postscale_factor), out=out, op_obj=op,
                   sync=sync)


def grouped_allreduce_async(arrays, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0, outs=None):
    """Many arrays as ONE collective: one name, one agreement, one handle, packed back to back into one bucket.
    wait() returns the list of results (the `outs` themselves when given, e.g. outs=arrays for in place)."""
    return _grouped_allreduce(arrays, op, name, prescale_factor, postscale_factor, outs, sync=False)


def grouped_allreduce(arrays, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0, outs=None):
    return _grouped_allreduce(arrays, op, name, prescale_factor, postscale_factor, outs, sync=True).wait()


def _grouped_allreduce(arrays, op, name, prescale_factor, postscale_factor, outs, sync):
    op = as_op(op)
    arrays = list(arrays)
    if not arrays:
        raise ValueError("grouped_allreduce needs at least one array")
    eng = state.engine()
    name = _auto_name("grouped_allreduce", name)
    outs = list(outs) if outs is not None else [None] * len(arrays)
    if len(outs) != len(arrays):
        raise ValueError(f"grouped_allreduce {name!r} got {len(arrays)} arrays but {len(outs)} outs")
    kinds = {}                       # (dtype, device) -> positions: one request per kind, usually exactly one
    for i, a in enumerate(arrays):
        kinds.setdefault((a.dtype, _check_array(a, f"grouped_allreduce {name!r} tensor {i}")), []).append(i)
    if len(kinds) == 1:
        return _group_request(eng, name, arrays, outs, op, prescale_factor, postscale_factor, sync)
    parts = [(positions, _group_request(eng, f"{name}.{dtype}.{device}", [arrays[i] for i in positions],
                                        [outs[i] for i in positions], op, prescale_factor, postscale_factor, sync))
             for (dtype, device), positions in sorted(kinds.items(), key=lambda kv: kv[1][0])]
    return MixedGroupHandle(len(arrays), parts)


def _group_request(eng, name, arrays, outs, op, prescale_factor, postscale_factor, sync):
    """One request for arrays of one dtype on one device."""
    device = _device_of(arrays[0])
    ops = ops_for(device)
    dtype = arrays[0].dtype
    # one pass of cheap checks per tensor: this loop is the whole per-tensor cost of a bucket
    sizes = []
    for i, (a, o) in enumerate(zip(arrays, outs)):
        if o is None:
            o = outs[i] = ops.empty(a.shape, dtype)
        elif o.shape != a.shape or o.dtype != dtype or not o.flags.c_contiguous:
            raise ValueError(f"grouped_allreduce {name!r}: out {i} has shape {o.shape} {o.dtype}, input "
                             f"{a.shape} {dtype} (outs must match and be C-contiguous)")
        sizes.append(a.size)
    meta = Meta(kind="allreduce", dtype=check_op_dtype(op, dtype), shape=(sum(sizes),), op=int(op), device=device,
                scales=(float(prescale_factor), float(postscale_factor)), parts=tuple(sizes))
    handle = Handle((name,), eng.drive)
    eng.submit(Request(name, meta, arrays, outs, handle, ops, ops.ready_event(), grouped=True), wake=not sync)
    return handle


class MixedGroupHandle(Handle):
    """A grouped allreduce over several dtypes: one request per dtype; wait() returns results in input order."""
    __slots__ = ("count", "parts")

    def __init__(self, count, parts):
        super().__init__(tuple(n for _, h in parts for n in h.names))
        self.count, self.parts = count, parts

    def done(self):
        return all(h.done() for _, h in self.parts)

    def poll(self):
        return all(h.poll() for _, h in self.parts)

    def wait(self, timeout=None):
        results = [None] * self.count
        for positions, handle in self.parts:
            for i, r in zip(positions, handle.wait(timeout)):
                results[i] = r
        self.times.update(started=min(h.times.get("started", 0.0) for _, h in self.parts),
                          finished=max(h.times.get("finished", 0.0) for _, h in self.parts))
        return results


# ------------------------------------------------------------------------------------------------ others
def allgather_async(array, name=None):
    """Concatenate every rank's array along dim 0 (dim 0 may differ per rank; the rest must match)."""
    if np.ndim(array) == 0:
        raise ValueError("allgather needs an array with at least one dimension")
    return _submit("allgather", array, name)


def allgather(array, name=None):
    if np.ndim(array) == 0:
        raise ValueError("allgather needs an array with at least one dimension")
    return _submit("allgather", array, name, sync=True).wait()


def _check_root(root_rank, what):
    if not isinstance(root_rank, (int, np.integer)) or isinstance(root_rank, bool):
        raise TypeError(f"{what}: root_rank must be an int, got {root_rank!r}")
    if not 0 <= root_rank < state.size():
        raise ValueError(f"{what}: root_rank {root_rank} is out of range for {state.size()} ranks")
    return int(root_rank)


def broadcast_async(array, root_rank=0, name=None, out=None):
    """Every rank gets root_rank's array. `out=array` broadcasts in place."""
    return _broadcast(array, root_rank, name, out, sync=False)


def _broadcast(array, root_rank, name, out, sync):
    root = _check_root(root_rank, "broadcast")
    device = _check_array(array, "broadcast")
    if out is None:
        out = ops_for(device).copy(array)
    elif out is not array:
        out[...] = array
    return _submit("broadcast", array, name, root=root, out=out, sync=sync)


def broadcast(array, root_rank=0, name=None, out=None):
    return _broadcast(array, root_rank, name, out, sync=True).wait()


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
    _submit("barrier", np.zeros(0, np.uint8), name, sync=True).wait()


# ------------------------------------------------------------------------------------------------ objects
def broadcast_object(obj, root_rank=0, name=None):
    """root's object on every rank, by pickle. Unpickling runs code from the root: trusted peers only."""
    root = _check_root(root_rank, "broadcast_object")
    base = _auto_name("broadcast_object", name)
    payload = np.frombuffer(pickle.dumps(obj), np.uint8) if state.rank() == root else np.zeros(0, np.uint8)
    length = broadcast(np.array([payload.size], np.int64), root, f"{base}.len")
    data = payload.copy() if state.rank() == root else np.empty(int(length[0]), np.uint8)
    data = broadcast(data, root, f"{base}.data", out=data)
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
    handle = Handle(("join",), eng.drive)
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
