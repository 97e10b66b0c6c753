"""How one call of the core API becomes a request to an engine: its name (an unnamed call's recurring slot), the
checks of its array, its Meta (the one place a request's metadata is made), and its queueing (Request, Handle).
collectives.py's calls use these; each call's own checks and result handling stay there.
"""
import numpy as np

from ..engine.fusion import HOST_OPS, ops_for
from ..engine.handle import Handle
from ..engine.model import Meta
from ..engine.request import Request
from .names import slot_name
from ..ops import check_op_dtype, dtype_name
from .routing import route


def call_name(kind, name, to):
    """Auto names count per process set (a set's members agree on them whatever else each of them runs). An
    unnamed call's name is a recurring slot (names.slot_name): when this rank still has that slot's previous
    collective in flight (an unnamed async call not waited for yet), this drives the engine until it is done."""
    if name is not None:
        return name if name.__class__ is str and name else slot_name(kind, name)    # (the latter raises)
    name = slot_name(kind if to.process_set_id == 0 else f"{kind}.set{to.process_set_id}", None)
    engine = to.engine
    if engine.intake.names:         # something in flight on this rank (else nothing to wait for: no call)
        engine.await_names_free(name)
    return name


def device_of(array):
    """'cpu' for numpy, 'cuda' for cupy-like arrays; anything else is a TypeError naming what was passed."""
    if isinstance(array, np.ndarray):
        return "cpu"
    if hasattr(array, "__cuda_array_interface__"):
        return "cuda"
    raise TypeError(f"expected a numpy or cupy array, got {type(array).__module__}.{type(array).__name__}; "
                    "torch tensors go through ringtrain.torch")


def check_array(array, what, *what_args):
    """The array's device; ValueError unless C-contiguous. `what % what_args` names the call in the error (formatted
    only then: this runs on every collective)."""
    device = device_of(array)
    if not array.flags.c_contiguous:
        raise ValueError(f"{what % what_args}: array of shape {array.shape} is not C-contiguous; pass "
                         "np.ascontiguousarray(x)")
    return device


_metas = {}         # the fields of a Meta -> the Meta: a training loop builds the same few thousand again and again


def meta_of(kind, dtype, shape, op, root, device, scales, splits):
    key = (kind, dtype, shape, op, root, device, scales, splits)
    meta = _metas.get(key)
    if meta is None:
        if len(_metas) > 65536:
            _metas.clear()
        meta = _metas[key] = Meta(kind=kind, dtype=dtype, shape=shape, op=op, root=root, device=device,
                                  scales=scales, splits=splits)
    return meta


def describe(kind, array, name, to, op=-1, root=-1, scales=(1.0, 1.0), splits=(), op_obj=None):
    """(name, Meta) of one array's collective on route `to`: the one place a request's metadata is made."""
    name = call_name(kind, name, to)
    device = check_array(array, "%s %r", kind, name)
    dt = dtype_name(array.dtype) if op_obj is None else check_op_dtype(op_obj, array.dtype)
    meta = meta_of(kind, dt, array.shape, int(op), root, device, (float(scales[0]), float(scales[1])), tuple(splits))
    return name, meta


def submit(kind, array, name, op=-1, root=-1, scales=(1.0, 1.0), splits=(), out=None, op_obj=None, sync=False,
           to=None):
    """Queue one request to the engine of route `to` (default: the world's; see routing.route)."""
    to = to if to is not None else route(None)
    name, meta = describe(kind, array, name, to, op, root, scales, splits, op_obj)
    return enqueue(to, name, meta, array, out, sync)


def enqueue(to, name, meta, array, out, sync, plan=None):
    handle = Handle((name,), to.engine.drive)
    if plan is not None:            # a host array's
        request = Request(name, meta, (array,), (out,), handle, HOST_OPS, None, plan=plan)
    else:
        ops = ops_for(meta.device)
        request = Request(name, meta, (array,), (out,), handle, ops, ops.ready_event())
    to.engine.run(request) if sync else to.engine.submit(request)
    return handle
