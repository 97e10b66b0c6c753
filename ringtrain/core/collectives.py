"""The core API on numpy (and cupy) arrays: validate on the caller's thread, queue to the engine, return a Handle
(how a call becomes a request -- its name, its Meta, its queueing -- is submission.py's; the grouped allreduce's
machinery is grouped.py's).

Bad input raises here, synchronously and on the rank that made the mistake, before anything reaches the other ranks,
so the job stays usable. Disagreements between ranks are found by the engine and come out of handle.wait().
"""
import pickle

import numpy as np

from . import state
from ..errors import RingtrainError, UnsupportedOperationError
from ..engine.fusion import HOST_OPS, ops_for
from ..engine.handle import DEFER_BYTES, Handle, HeldHandle
from . import adasum, grouped
from .group_handles import ListHandle
from .names import auto_name
from ..engine.express_memo import ExpressPlan
from ..engine.model import express_eligible
from ..ops import Average, ReduceOp, Sum, as_op, is_adasum
from .routing import route
from .submission import (call_name as _name, check_array as _check_array, describe as _describe,
                         device_of as _device_of, enqueue as _enqueue, submit as _submit)
from ..engine.request import Request


# ------------------------------------------------------------------------------------------------ allreduce
def allreduce_async(array, op=Average, name: "str | None" = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0, out=None, process_set: "ProcessSet | None" = None) -> Handle:
    """Reduce `array` over all ranks (of `process_set`). `out=array` reduces in place. Average divides by the number
    of ranks (integers: rounded toward zero, as Horovod)."""
    if op.__class__ is not ReduceOp and is_adasum(op):
        return _adasum([array], None if out is None else [out], name, prescale_factor, postscale_factor,
                       process_set, False, True)
    to = route(process_set)
    op = op if op.__class__ is ReduceOp else as_op(op)
    out = _allreduce_out(array, out, to)
    name, meta, plan = _allreduce_plan(to, name, op, array, prescale_factor, postscale_factor)
    if plan is not None and plan.nbytes <= DEFER_BYTES:
        # a small recurring allreduce: held back (no request yet) for a prompt wait (Engine.hold)
        engine = to.engine
        held = HeldHandle(name, plan, array, out, engine)
        if not engine.hold(held):
            engine.submit(Request(name, meta, (array,), (out,), held, HOST_OPS, plan=plan))
        return held
    return _enqueue(to, name, meta, array, out, False, plan)


def allreduce(array, op=Average, name: "str | None" = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, out=None, process_set: "ProcessSet | None" = None):
    """Reduce `array` over all ranks (of `process_set`) and return the result, a new array unless `out` is given
    (`out=array` reduces in place). `op` is Average (the default: the sum divided by the number of ranks; integers
    rounded toward zero, as Horovod), Sum, Min, Max, Product or Adasum (float tensors, a power-of-two number of
    ranks: ringtrain.core.adasum). The input is multiplied by `prescale_factor` before the reduction and the result
    by `postscale_factor` after it. Ranks must call it with the same shape, dtype and op under the same `name`
    (default: derived from the call order); a mismatch raises TensorMismatchError on every rank."""
    if op.__class__ is not ReduceOp:
        if is_adasum(op):
            return _adasum([array], None if out is None else [out], name, prescale_factor, postscale_factor,
                           process_set, True, True).wait()
        op = as_op(op)
    to = route(process_set)
    out = _allreduce_out(array, out, to)
    name, meta, plan = _allreduce_plan(to, name, op, array, prescale_factor, postscale_factor)
    resumed = None
    if plan is not None:
        fast = plan.fast
        if fast is not None:    # the whole express call in one C call (CycleAgreement._read_plan), when armed
            resumed = fast[0](fast, array, out)
            if resumed is True:
                return out
    # a cached host allreduce with nothing else in flight takes one agreement cycle on this thread, with no
    # request and no handle (Engine.express decides whether it applies); anything else takes the general path
    done = to.engine.express(name, meta, array, out, None, plan, resumed)
    if done is True:
        return out
    if done is not None:
        return done.wait()
    return _enqueue(to, name, meta, array, out, sync=True, plan=plan).wait()


def _allreduce_plan(to, name, op, array, prescale_factor, postscale_factor):
    """(name, Meta, ExpressPlan or None) of one array's allreduce on route `to`. A numpy array's call recurs under
    the key (name -- an unnamed call's slot --, op, dtype, shape, scales): its plan comes from the engine's memo
    (express_memo.py) with no Meta built or hashed; the first call of a key describes it (and checks it) as every
    other collective does, and keeps a plan when the express path can take it."""
    if name.__class__ is not str or not name:      # (a named call's name is itself: no call)
        name = _name("allreduce", name, to)
    if array.__class__ is not np.ndarray:
        name, meta = _describe("allreduce", array, name, to, op=op, scales=(prescale_factor, postscale_factor),
                               op_obj=op)
        return name, meta, None
    key = (name, op, array.dtype, array.shape, float(prescale_factor), float(postscale_factor))
    memo = to.engine.memo
    plan = memo.get(key)
    if plan is not None and array.flags.c_contiguous:
        return name, plan.meta, plan
    name, meta = _describe("allreduce", array, name, to, op=op, scales=(prescale_factor, postscale_factor),
                           op_obj=op)
    return name, meta, memo.put(key, ExpressPlan(name, meta)) if express_eligible(meta) else None


def _allreduce_out(array, out, to):
    if out is array:            # in place
        return out
    if out is None:
        if array.__class__ is np.ndarray:
            results = HOST_OPS.results
            if array.nbytes < results.plain_below:     # the pool's own rule for small results, without its call
                return np.empty(array.shape, array.dtype)
            return results.empty(array.shape, array.dtype, to.engine.transports["cpu"])
        return ops_for(_device_of(array)).empty(array.shape, array.dtype)
    if out.shape != array.shape or out.dtype != array.dtype:
        raise ValueError(f"allreduce out has shape {out.shape} {out.dtype}, input {array.shape} {array.dtype}")
    return out


def grouped_allreduce_async(arrays, op=Average, name: "str | None" = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0, outs=None,
                            process_set: "ProcessSet | None" = None) -> Handle:
    """Many arrays as ONE collective: one name, one agreement, one handle, packed back to back into one bucket.
    wait() returns the list of results (the `outs` themselves when given, e.g. outs=arrays for in place)."""
    if is_adasum(op):
        return _adasum(arrays, outs, name, prescale_factor, postscale_factor, process_set, False, False)
    return grouped.start(arrays, op, name, prescale_factor, postscale_factor, outs, False, process_set)


def grouped_allreduce(arrays, op=Average, name: "str | None" = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, outs=None, process_set: "ProcessSet | None" = None) -> list:
    """Allreduce several arrays as one collective (one agreement, packed into one bucket) and return the list of
    results (new arrays; those of a small group may be views of one new array, never of the inputs); `outs=arrays`
    reduces them in place. Arguments as allreduce(); with op=Adasum each array's dot products are its own, so the
    result is each array's Adasum."""
    if op.__class__ is not ReduceOp:
        if is_adasum(op):
            return _adasum(arrays, outs, name, prescale_factor, postscale_factor, process_set, True, False).wait()
        op = as_op(op)
    return grouped.allreduce(arrays, op, name, prescale_factor, postscale_factor, outs, process_set)


def _grouped(kind, start, arrays, name, process_set):
    """A ListHandle over `start(array, part_name)` for each array; parts are named <base>.<i>, so ranks agree."""
    arrays = list(arrays)
    if not arrays:
        raise ValueError(f"{kind} needs at least one array")
    base = _name(kind, name, route(process_set))
    return ListHandle([start(a, f"{base}.{i}") for i, a in enumerate(arrays)])


def _adasum(arrays, outs, name, prescale_factor, postscale_factor, process_set, sync, single):
    """op=Adasum: adasum.py's halving steps over this set's alltoall (a pairwise exchange: only the partner's split
    is non-zero) and allgather, under names derived from this call's."""
    to = route(process_set)
    base = auto_name("adasum" if to.process_set_id == 0 else f"adasum.set{to.process_set_id}", name)
    arrays = list(arrays)
    for i, array in enumerate(arrays):
        if _check_array(array, "allreduce %r tensor %d", base, i) != "cpu":
            raise UnsupportedOperationError(f"allreduce {base!r}: op=Adasum reduces host arrays; copy to the host")

    def exchange(send, partner, tag):
        splits = [send.size if r == partner else 0 for r in range(to.size)]
        return alltoall(send, splits, f"{base}.{tag}", process_set)[0]
    steps = adasum.Steps(exchange, lambda array, tag, out: allgather(array, f"{base}.{tag}", process_set, out),
                         lambda array, tag: allreduce(array, Sum, f"{base}.{tag}", process_set=process_set))
    return adasum.start(arrays, outs, prescale_factor, postscale_factor, to.rank, to.size, steps,
                        f"allreduce {base!r}", sync, single)


# ------------------------------------------------------------------------------------------------ others
def allgather_async(array, name: "str | None" = None, process_set: "ProcessSet | None" = None,
                    out=None) -> Handle:
    """Concatenate every rank's array along dim 0 (dim 0 may differ per rank; the rest must match), in rank order
    (within the set). `out`: see allgather()."""
    to = route(process_set)
    _check_allgather(array, out)
    return _submit("allgather", array, name, out=out, to=to)


def allgather(array, name: "str | None" = None, process_set: "ProcessSet | None" = None, out=None):
    """Every rank's array concatenated along dim 0, in rank order (within the set). Dim 0 may differ per rank; the
    other dimensions and the dtype must match. The result is a new array unless `out` is given: a C-contiguous
    array of the gathered shape and the input's dtype, written in place (the result then IS out; a wrong dim 0 is
    a ValueError from wait(), on this rank only). When `array` already lies at this rank's place in `out` (a view
    of it), this rank's part is not copied at all: a sharded optimizer gathers parameters into themselves."""
    to = route(process_set)
    _check_allgather(array, out)
    return _submit("allgather", array, name, out=out, sync=True, to=to).wait()


def _check_allgather(array, out):
    if np.ndim(array) == 0:
        raise ValueError("allgather needs an array with at least one dimension")
    if out is None:
        return
    if _device_of(out) != _device_of(array) or out.dtype != array.dtype or out.shape[1:] != array.shape[1:]:
        raise ValueError(f"allgather out has shape {out.shape} {out.dtype} on {_device_of(out)}, the input "
                         f"{array.shape} {array.dtype} on {_device_of(array)}: out needs the input's dtype and "
                         "device and its shape past dim 0")
    if not out.flags.c_contiguous:
        raise ValueError(f"allgather out of shape {out.shape} is not C-contiguous")


def grouped_allgather_async(arrays, name: "str | None" = None, process_set: "ProcessSet | None" = None) -> Handle:
    """allgather of each array under one handle; wait() returns the list of results."""
    return _grouped("grouped_allgather", lambda a, n: allgather_async(a, n, process_set), arrays, name, process_set)


def grouped_allgather(arrays, name: "str | None" = None, process_set: "ProcessSet | None" = None) -> list:
    """allgather() of each array; returns the list of results."""
    return grouped_allgather_async(arrays, name, process_set).wait()


def _check_root(root_rank, what, to):
    """root_rank is a world rank (Horovod's convention, process sets included); returns it as a rank of the set."""
    if not isinstance(root_rank, (int, np.integer)) or isinstance(root_rank, bool):
        raise TypeError(f"{what}: root_rank must be an int, got {root_rank!r}")
    if not 0 <= root_rank < state.size():
        raise ValueError(f"{what}: root_rank {root_rank} is out of range for {state.size()} ranks")
    return to.set_rank(int(root_rank), what)


def broadcast_async(array, root_rank: int = 0, name: "str | None" = None, out=None,
                    process_set: "ProcessSet | None" = None) -> Handle:
    """Every rank gets root_rank's array. `out=array` broadcasts in place. root_rank is a world rank."""
    return _broadcast(array, root_rank, name, out, False, process_set)


def _broadcast(array, root_rank, name, out, sync, process_set):
    to = route(process_set)
    root = _check_root(root_rank, "broadcast", to)
    device = _check_array(array, "broadcast")
    if out is None:
        out = ops_for(device).copy(array)
    elif out is not array:
        out[...] = array
    return _submit("broadcast", array, name, root=root, out=out, sync=sync, to=to)


def broadcast(array, root_rank: int = 0, name: "str | None" = None, out=None,
              process_set: "ProcessSet | None" = None):
    """`root_rank`'s array on every rank: a new array, or written into `out` (`out=array` in place). `root_rank` is a
    world rank, also for a process set."""
    return _broadcast(array, root_rank, name, out, True, process_set).wait()


def alltoall_async(array, splits=None, name: "str | None" = None, process_set: "ProcessSet | None" = None) -> Handle:
    """Send rows splits[j] of `array` (in order) to rank j (of the set); wait() returns (received array, received
    splits)."""
    to = route(process_set)
    if np.ndim(array) == 0:
        raise ValueError("alltoall needs an array with at least one dimension")
    n = to.size
    if splits is None:
        if array.shape[0] % n:
            raise ValueError(f"alltoall without splits needs dim 0 ({array.shape[0]}) divisible by size ({n})")
        splits = [array.shape[0] // n] * n
    splits = [int(s) for s in np.asarray(splits).reshape(-1)]
    if len(splits) != n or any(s < 0 for s in splits) or sum(splits) != array.shape[0]:
        raise ValueError(f"alltoall splits {splits} must have {n} non-negative entries summing to dim 0 "
                         f"({array.shape[0]})")
    return _submit("alltoall", array, name, splits=splits, to=to)


def alltoall(array, splits=None, name: "str | None" = None, process_set: "ProcessSet | None" = None) -> tuple:
    """Send rows `splits[j]` of `array` (consecutive blocks of dim 0) to rank j of the set and return (the rows
    received from every rank, concatenated in rank order; how many came from each). Without `splits`, dim 0 is cut
    into equal blocks."""
    return alltoall_async(array, splits, name, process_set).wait()


def reducescatter_async(array, op=Average, name: "str | None" = None, process_set: "ProcessSet | None" = None,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
    """Reduce over ranks, then keep this rank's block of dim 0 (split as evenly as possible, first blocks larger)."""
    to = route(process_set)
    op = as_op(op)
    if np.ndim(array) == 0:
        raise ValueError("reducescatter needs an array with at least one dimension")
    return _submit("reducescatter", array, name, op=op, op_obj=op, scales=(prescale_factor, postscale_factor), to=to)


def reducescatter(array, op=Average, name: "str | None" = None, process_set: "ProcessSet | None" = None,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0):
    """Reduce `array` over the ranks as allreduce() does, and return only this rank's block of dim 0 (dim 0 split as
    evenly as possible, the first blocks one row larger)."""
    return reducescatter_async(array, op, name, process_set, prescale_factor, postscale_factor).wait()


def grouped_reducescatter_async(arrays, op=Average, name: "str | None" = None,
                                process_set: "ProcessSet | None" = None, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> Handle:
    """reducescatter of each array under one handle; wait() returns the list of this rank's blocks."""
    return _grouped("grouped_reducescatter",
                    lambda a, n: reducescatter_async(a, op, n, process_set, prescale_factor, postscale_factor),
                    arrays, name, process_set)


def grouped_reducescatter(arrays, op=Average, name: "str | None" = None, process_set: "ProcessSet | None" = None,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> list:
    """reducescatter() of each array under one handle; returns the list of this rank's blocks."""
    return grouped_reducescatter_async(arrays, op, name, process_set, prescale_factor, postscale_factor).wait()


def barrier(name: "str | None" = None, process_set: "ProcessSet | None" = None) -> None:
    """Returns once every rank (of `process_set`) has called barrier()."""
    _submit("barrier", np.zeros(0, np.uint8), name, sync=True, to=route(process_set)).wait()


# ------------------------------------------------------------------------------------------------ objects
def broadcast_object(obj, root_rank: int = 0, name: "str | None" = None, process_set: "ProcessSet | None" = None):
    """root's object on every rank, by pickle. Unpickling runs code from the root: trusted peers only."""
    to = route(process_set)
    _check_root(root_rank, "broadcast_object", to)
    is_root = state.rank() == root_rank
    base = _name("broadcast_object", name, to)
    payload = np.frombuffer(pickle.dumps(obj), np.uint8) if is_root else np.zeros(0, np.uint8)
    length = broadcast(np.array([payload.size], np.int64), root_rank, f"{base}.len", process_set=process_set)
    data = payload.copy() if is_root else np.empty(int(length[0]), np.uint8)
    data = broadcast(data, root_rank, f"{base}.data", out=data, process_set=process_set)
    return obj if is_root else pickle.loads(data.tobytes())


def allgather_object(obj, name: "str | None" = None, process_set: "ProcessSet | None" = None) -> list:
    """List of every rank's object (pickled; trusted peers only), in rank order within the set."""
    base = _name("allgather_object", name, route(process_set))
    payload = np.frombuffer(pickle.dumps(obj), np.uint8)
    lengths = allgather(np.array([payload.size], np.int64), f"{base}.len", process_set)
    data = allgather(payload, f"{base}.data", process_set)
    out, start = [], 0
    for n in lengths:
        out.append(pickle.loads(data[start:start + int(n)].tobytes()))
        start += int(n)
    return out


def join() -> int:
    """This rank has no more data. Until every rank has joined, it takes part in the others' allreduces with zeros
    (Average still divides by size()). Returns the rank that joined last."""
    eng = state.engine()
    handle = Handle(("join",), eng.drive)
    eng.join(handle)
    return handle.wait()


def synchronize(handle: Handle):
    """Block until the collective behind `handle` finishes and return its result (the same as handle.wait()); an error
    of the collective is raised here."""
    return handle.wait()


def poll(handle: Handle) -> bool:
    """True once the collective behind `handle` has finished (successfully or not); never blocks."""
    return handle.poll()


__all__ = ["allreduce", "allreduce_async", "grouped_allreduce", "grouped_allreduce_async", "allgather",
           "allgather_async", "grouped_allgather", "grouped_allgather_async", "broadcast", "broadcast_async",
           "alltoall", "alltoall_async", "reducescatter", "reducescatter_async", "grouped_reducescatter",
           "grouped_reducescatter_async", "barrier", "broadcast_object", "allgather_object", "join", "synchronize", "poll",
           "RingtrainError"]
