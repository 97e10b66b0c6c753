"""The grouped allreduce: several arrays as one collective (one name, one agreement, one bucket).

    results = allreduce(arrays, op, name, prescale_factor, postscale_factor, outs, process_set)   # synchronous
    handle = start(arrays, op, name, prescale_factor, postscale_factor, outs, sync, process_set)   # a Handle
    results, name, key = planned_call(addresses, signature, op, name, pre, post, process_set)    # a binding's

collectives.grouped_allreduce / grouped_allreduce_async are the public face (they also route op=Adasum, which is
not this module's). A recurring small synchronous group of one dtype has a GroupPlan in the engine's memo
(express_memo.py): its members are packed into one fresh array (one call of the compiled module, which reads them
where they lie) and that array is reduced in place as one small allreduce, whose views are the results (planned). A
binding may describe its tensors itself and hand over their addresses (planned_call). Anything else becomes one
request per (dtype, device).
"""
from functools import partial
from operator import itemgetter
from sys import getrefcount

import numpy as np

from ..engine.fusion import HOST_OPS, ops_for
from ..engine.handle import Handle
from .group_handles import MixedGroupHandle
from ..engine.express_memo import ExpressPlan
from ..engine import native_cycle
from ..engine.model import Meta, express_eligible
from ..ops import as_op, check_op_dtype
from .routing import route
from .submission import call_name as _name, check_array as _check_array, device_of as _device_of
from ..engine.request import Request
from ..transports.segments import Segments


def allreduce(arrays, op, name, prescale_factor, postscale_factor, outs, process_set, key=None):
    """collectives.grouped_allreduce for any op but Adasum (`op` a ReduceOp). key: the memo key a binding made
    (planned_call), else this call's own."""
    to = route(process_set)
    arrays = list(arrays)
    name = _name("grouped_allreduce", name, to) if arrays else name
    # a recurring group of C-contiguous numpy arrays (the same name, op, scales, dtypes and shapes) has a GroupPlan
    # in the engine's memo (express_memo.py): one express cycle that reads the arrays where they lie (a key with a
    # non-contiguous array never has a plan)
    if key is None and outs is None:
        signature = tuple([(a.dtype, a.shape, a.flags.c_contiguous) for a in arrays if a.__class__ is np.ndarray])
        if len(signature) == len(arrays) > 1:
            key = (name, op, float(prescale_factor), float(postscale_factor), signature)
    memo = to.engine.memo
    plan = None if key is None else memo.get(key)
    if plan is not None:
        return list(planned(to.engine, plan, tuple(arrays)))
    results = start(arrays, op, name, prescale_factor, postscale_factor, outs, True, process_set).wait()
    if key is not None:
        plan_for(memo, key, name, op, prescale_factor, postscale_factor, arrays)
    return results


def planned_call(members, signature, op, name, prescale_factor, postscale_factor, process_set):
    """A binding's recurring group, described by the binding: `signature` (hashable) fixes each member's dtype and
    shape and says it is C-contiguous host memory, `members` are the members' int addresses (valid during the
    call). (results, name, key): the result arrays (a sequence) when the group has a plan, else (None, the call's
    name, the memo key): the binding then calls allreduce(its numpy arrays, op, name, ..., key=key), which makes the
    plan when the group allows one."""
    to = route(process_set)
    if name.__class__ is not str or not name:           # (a named call needs no call_name)
        name = _name("grouped_allreduce", name, to)
    key = (name, op, float(prescale_factor), float(postscale_factor), signature)
    plan = to.engine.memo.get(key)
    if plan is not None and plan.addresses:
        return planned(to.engine, plan, members), name, key
    return None, name, key


def compiled_reader():
    """The compiled module's read_group(tensors) -> (signature, members) (csrc/express_group.c: a torch group's
    planned_call arguments in one call), or None when the module is not built."""
    module = native_cycle.library()
    return None if isinstance(module, str) else module.read_group


class GroupPlan(ExpressPlan):
    """A recurring small group's express facts (ExpressPlan's) and its layout: the members' byte sizes and where
    each result lies in the packed result (slice, and shape or None for 1-D: the slice is the result as it is);
    views(packed): the results, as views of the packed result (one itemgetter call when every member is 1-D);
    spare: the last packed array (planned() hands it out again once nothing else refers to it)."""
    __slots__ = ("sizes", "dtype", "count", "layout", "addresses", "pack", "views", "spare")

    def __init__(self, name, meta, arrays):
        super().__init__(name, meta)
        self.sizes = tuple([a.nbytes for a in arrays])
        self.dtype = arrays[0].dtype
        self.count = sum([a.size for a in arrays])
        layout, offset = [], 0
        for a in arrays:
            layout.append((slice(offset, offset + a.size), None if len(a.shape) == 1 else a.shape))
            offset += a.size
        self.layout = tuple(layout)
        flat = len(layout) > 1 and all([shape is None for _, shape in layout])
        self.views = itemgetter(*[part for part, _ in layout]) if flat else partial(_shaped_views, self.layout)
        module = native_cycle.library()
        self.addresses = not isinstance(module, str)        # members may be int addresses: the compiled pack
        self.pack = module.pack_group if self.addresses else _pack_buffers      # (members, sizes, out)
        self.spare = None


def plan_for(memo, key, name, op, prescale_factor, postscale_factor, arrays):
    """Keep a GroupPlan under `key` for a group of C-contiguous host arrays (the core refuses any other) of one dtype
    that the express path can take whole (see _group_meta); returns it, or None."""
    if len({a.dtype for a in arrays}) != 1:
        return None
    meta, eligible, packed = _group_meta(op, arrays[0].dtype, "cpu", prescale_factor, postscale_factor,
                                         tuple([a.size for a in arrays]))
    return memo.put(key, GroupPlan(name, meta, arrays)) if packed else None


def planned(eng, plan, members):
    """A recurring small synchronous grouped allreduce: the members (C-contiguous host buffers of plan.sizes bytes,
    or their int addresses when the native cycle is built: native_cycle.pack) packed into one array that nothing
    else refers to, which is reduced in place as one small allreduce: first offered to the compiled module whole
    (plan.fast, as collectives.allreduce does; True is done), else express_packed, which also finishes a cycle the
    compiled call published but did not finish (resumed). The results (a sequence) are views of that array.

    The array is the last call's (plan.spare) when nothing but the plan and this frame refers to it: each result of
    that call -- a view of it, a torch tensor made from one, anything viewing those -- holds a reference to it (as
    result_pool.py's blocks), so a result someone keeps is never written again; else a fresh one. Nothing else can
    take a reference to the spare (it is reached only through the plan), and a second thread that reads it before
    this one returns holds a reference of its own, so it makes a fresh one."""
    packed = plan.spare
    if packed is None or getrefcount(packed) > 3:      # (the plan's, this frame's and getrefcount's own)
        packed = plan.spare = np.empty(plan.count, plan.dtype)
    plan.pack(members, plan.sizes, packed)
    fast = plan.fast
    resumed = None if fast is None else fast[0](fast, packed, packed)
    if resumed is not True:
        express_packed(eng, plan.name, plan.meta, packed, plan, resumed)
    return plan.views(packed)


def _shaped_views(layout, packed):
    """GroupPlan.views of a group with members of more than one dimension."""
    return [packed[part] if shape is None else packed[part].reshape(shape) for part, shape in layout]


def _pack_buffers(members, sizes, out):
    """GroupPlan.pack without the compiled module (buffers only)."""
    native_cycle.pack((members, sizes), out)


def express_packed(eng, name, meta, packed, plan=None, resumed=None):
    """A small synchronous group packed into one array, reduced in place: one express cycle, or an ordinary request
    when the express path does not apply. Every rank packs (the choice depends on the agreed metadata alone), so
    every rank makes the same transport call whichever path each takes (the executor's invariant). resumed: the
    compiled call's outcome for a planned one (planned()): a cycle it published but did not finish is finished by
    Engine.express."""
    done = eng.express(name, meta, packed, packed, None, plan, resumed)
    if done is None:
        done = Handle((name,), eng.drive)
        eng.run(Request(name, meta, (packed,), (packed,), done, HOST_OPS, plan=plan))
    if done is not True:
        done.wait()


def start(arrays, op, name, prescale_factor, postscale_factor, outs, sync, process_set):
    """The grouped allreduce as requests (one per dtype and device; sync: run on this thread): its Handle."""
    to = route(process_set)
    op = as_op(op)
    arrays = list(arrays)
    if not arrays:
        raise ValueError("grouped_allreduce needs at least one array")
    eng = to.engine
    name = _name("grouped_allreduce", name, to)
    outs = list(outs) if outs is not None else [None] * len(arrays)
    if len(outs) != len(arrays):
        raise ValueError(f"grouped_allreduce {name!r} got {len(arrays)} arrays but {len(outs)} outs")
    kinds = {}                       # (dtype, device) -> positions: one request per kind, usually exactly one
    for i, a in enumerate(arrays):
        kinds.setdefault((a.dtype, _check_array(a, "grouped_allreduce %r tensor %d", name, i)), []).append(i)
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
    meta, eligible, packed = _group_meta(op, dtype, device, prescale_factor, postscale_factor, tuple(sizes))
    if sync and len(arrays) > 1 and eligible:
        # as allreduce(): with nothing else in flight, one agreement cycle on this thread. A small group is packed
        # into one array, which travels in the cycle's slots as one small allreduce does (the cycle is then the only
        # synchronisation; a copy of a few KB costs far less than the transport's own barriers); a larger one is
        # read and written by the transport where it lies (Segments), with no pack or unpack at all
        if packed:
            return _packed_express(eng, name, meta, arrays, outs, sizes)
        source = Segments(arrays)
        in_place = all(o is a for o, a in zip(outs, arrays))
        done = eng.express(name, meta, source, source if in_place else Segments(outs))
        if done is True:
            handle = Handle((name,), eng.drive)
            handle._set_result(list(outs))
            return handle
        if done is not None:
            return done
    handle = Handle((name,), eng.drive)
    request = Request(name, meta, arrays, outs, handle, ops, ops.ready_event(), grouped=True)
    eng.run(request) if sync else eng.submit(request)
    return handle


GROUP_PACK_BYTES = 64 << 10     # a synchronous grouped allreduce up to this size is packed for the express path
_group_metas = {}               # (op, dtype, device, scales, sizes) -> (Meta, express eligible, packed): a step's
                                # groups recur, and a Meta built per call costs more than the cycle's own work


def _group_meta(op, dtype, device, prescale_factor, postscale_factor, sizes):
    """(Meta, express eligible, packed) of a grouped allreduce of arrays of `sizes` elements (one dtype, one device):
    made once per distinct group (as _meta() does for single arrays)."""
    key = (int(op), dtype, device, float(prescale_factor), float(postscale_factor), sizes)
    hit = _group_metas.get(key)
    if hit is None:
        meta = Meta(kind="allreduce", dtype=check_op_dtype(op, dtype), shape=(sum(sizes),), op=int(op),
                    device=device, scales=key[3:5], parts=sizes)
        eligible = express_eligible(meta)
        if len(_group_metas) > 4096:
            _group_metas.clear()
        hit = _group_metas[key] = (meta, eligible, eligible and meta.nbytes <= GROUP_PACK_BYTES)
    return hit


def _packed_express(eng, name, meta, arrays, outs, sizes):
    """A small synchronous grouped allreduce with no plan: packed, reduced (express_packed), copied into outs."""
    packed = np.concatenate([a.reshape(-1) for a in arrays])
    express_packed(eng, name, meta, packed)
    offset = 0
    for out, n in zip(outs, sizes):
        out.reshape(-1)[...] = packed[offset:offset + n]
        offset += n
    handle = Handle((name,), eng.drive)
    handle._set_result(list(outs))
    return handle
