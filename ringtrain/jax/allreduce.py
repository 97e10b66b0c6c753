"""allreduce and grouped_allreduce of jax.Arrays over the ranks of a process set.

    import ringtrain.jax as hvd
    hvd.init()
    total = hvd.allreduce(jnp.ones(3), op=hvd.Sum)          # [size, size, size], eagerly or under jax.jit
    a, b = hvd.grouped_allreduce([x, y])                    # one agreement, one fused bucket; averaged

Gradient (Horovod's rule, ringtrain.reducer.gradient_rules): the cotangent allreduced with the same op and scale factors.
"""
import dataclasses

import jax
import numpy as np
from jax._src.array import ArrayImpl

from ringtrain.core import collectives
from ringtrain.ops import Average, ReduceOp, resolve_op
from ringtrain.core.process_sets import ProcessSet, global_process_set

from . import gradients
from .arrays import (COPIED_BYTES, WIRE_VIEWED, Wire, aligned_empty, check_reduction, check_scales, copy_to_jax,
                     result_empty, to_jax, to_numpy)
from .host_call import collective_primitive, differentiable, same_avals
from .naming import collective_name


POOLED_BYTES = 256 << 10     # results from here up come from the core's result pool


@dataclasses.dataclass(frozen=True)
class AllreduceSpec:
    name: str
    op: ReduceOp
    prescale_factor: float
    postscale_factor: float
    process_set: ProcessSet


def _run(*arrays, spec):
    """One core call: allreduce for one array (the engine's express path), grouped_allreduce for several."""
    wires = [Wire(a, spec.op) for a in arrays]
    for w in wires:
        check_scales(w, spec.prescale_factor, spec.postscale_factor, f"allreduce {spec.name!r}")
    # results land in 64-byte-aligned buffers, so eagerly they become jax.Arrays without a copy (arrays.to_jax):
    # small ones here, large ones from the core's result pool (aligned there)
    outs = [aligned_empty(w.array.shape, w.array.dtype) if w.array.nbytes < POOLED_BYTES else None for w in wires]
    op = wires[0].op if len({w.op for w in wires}) == 1 else None
    if op is None:                           # unsigned Average next to other dtypes: one request per wire op
        results = [collectives.allreduce(w.array, w.op, f"{spec.name}.{i}", spec.prescale_factor,
                                   spec.postscale_factor, out=out, process_set=spec.process_set)
                   for i, (w, out) in enumerate(zip(wires, outs))]
    elif len(wires) == 1:
        results = [collectives.allreduce(wires[0].array, op, spec.name, spec.prescale_factor, spec.postscale_factor,
                                   out=outs[0], process_set=spec.process_set)]
    else:
        results = collectives.grouped_allreduce([w.array for w in wires], op, spec.name, spec.prescale_factor,
                                          spec.postscale_factor, outs=outs, process_set=spec.process_set)
    size = spec.process_set.size()
    return [w.back(r, size) for w, r in zip(wires, results)]


def _backward(spec, _, cotangents):
    return gradients.backward("allreduce", cotangents, spec, op=spec.op, prescale_factor=spec.prescale_factor,
                              postscale_factor=spec.postscale_factor)


allreduce_p = collective_primitive("ringtrain_allreduce", _run, same_avals)
_allreduce = differentiable(allreduce_p, _backward)
gradients.register("allreduce", AllreduceSpec, _allreduce)


def _spec(kind, name, op, average, prescale_factor, postscale_factor, process_set):
    return AllreduceSpec(collective_name(kind, name, process_set), resolve_op(op, average, adasum=True),
                         float(prescale_factor), float(postscale_factor), process_set)


def allreduce(tensor, op=None, name=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set,
              average=None, compression=None):
    """Reduce `tensor` (a jax.Array or anything jnp.asarray takes) over the set's ranks; default op Average
    (integers: floor). `compression` (e.g. Compression.fp16) casts it for the wire and back. Differentiable."""
    if type(tensor) is _ARRAY and compression is None:
        # a concrete array (a Tracer is another type): the core's synchronous call on a read-only view of it, for
        # every dtype the core reduces as it is (the core checks op and dtype: one rule for every binding). The
        # core's own result comes back: small, XLA copies it (cheaper than aliasing it); large, from the core's
        # 64-byte-aligned result pool, XLA adopts it without a copy
        array = np.asarray(tensor)
        if array.dtype not in WIRE_VIEWED and array.flags.c_contiguous:       # (a dtype with no Wire view)
            result = collectives.allreduce(array, Average if op is None and average is None else
                                           resolve_op(op, average, adasum=True), name, float(prescale_factor),
                                           float(postscale_factor), None, process_set)
            return copy_to_jax(result) if result.nbytes < COPIED_BYTES else to_jax(result)
    if not isinstance(tensor, jax.Array):
        tensor = jax.numpy.asarray(tensor)
    if not isinstance(tensor, jax.core.Tracer):
        return _allreduce_eager(tensor, op, name, prescale_factor, postscale_factor, process_set, average,
                                compression)
    spec = _spec("allreduce", name, op, average, prescale_factor, postscale_factor, process_set)
    wire, ctx = compression.compress(tensor) if compression is not None else (tensor, None)
    check_reduction(wire.dtype, spec.op, f"allreduce {spec.name!r}")
    (reduced,) = _allreduce((wire,), spec)
    return compression.decompress(reduced, ctx) if compression is not None else reduced


_ARRAY = ArrayImpl     # jax's concrete array type (not made from an array: that would start JAX's backend at import)
_REDUCIBLE = set()     # (dtype, op) pairs check_reduction passed


def _what(name):
    return f"allreduce {name!r}" if name is not None else "allreduce"


def _allreduce_eager(tensor, op, name, prescale_factor, postscale_factor, process_set, average, compression):
    """A concrete array outside any trace (no jit, no grad: those see Tracers) that the fast path in allreduce did
    not take (compressed, or a dtype with a wire view): the core's synchronous call on a view of it, with no
    primitive, custom_vjp or callback around it. Unnamed calls take the core's recurring unnamed names (cached, so
    they run express)."""
    op = resolve_op(op, average, adasum=True)
    wire, ctx = compression.compress(tensor) if compression is not None else (tensor, None)
    if (wire.dtype, op) not in _REDUCIBLE:      # checked once per pair (~1 us a call otherwise)
        check_reduction(wire.dtype, op, _what(name))
        _REDUCIBLE.add((wire.dtype, op))
    w = Wire(to_numpy(wire), op)
    if w.divide_by_size:                        # the one case check_scales refuses
        check_scales(w, prescale_factor, postscale_factor, _what(name))
    # results land 64-byte aligned (here, or from the core's result pool) and are adopted without a copy; each call
    # gets its own buffer (a pool block only once nothing refers to it: the jax.Array does while it lives)
    out = result_empty(w.array.shape, w.array.dtype) if w.array.nbytes < POOLED_BYTES else None
    result = collectives.allreduce(w.array, w.op, name, float(prescale_factor), float(postscale_factor), out=out,
                                   process_set=process_set)
    reduced = to_jax(w.back(result, process_set.size()))
    return reduced if compression is None else compression.decompress(reduced, ctx)


def grouped_allreduce(tensors, op=None, name=None, prescale_factor=1.0, postscale_factor=1.0,
                      process_set=global_process_set, average=None, compression=None):
    """Allreduce a list (or pytree) of arrays as ONE collective: one name, one agreement, one fused bucket.
    Returns the same structure. Differentiable."""
    leaves, tree = jax.tree_util.tree_flatten(tensors)
    if not leaves:
        raise ValueError("grouped_allreduce needs at least one array")
    spec = _spec("grouped_allreduce", name, op, average, prescale_factor, postscale_factor, process_set)
    leaves = [jax.numpy.asarray(x) for x in leaves]
    for x in leaves:
        check_reduction(compression.compress(x)[0].dtype if compression is not None else x.dtype, spec.op,
                        f"grouped_allreduce {spec.name!r}")
    if compression is not None:
        packed = [compression.compress(x) for x in leaves]
        reduced = _allreduce(tuple(w for w, _ in packed), spec)
        reduced = [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, packed)]
    else:
        reduced = _allreduce(tuple(leaves), spec)
    return jax.tree_util.tree_unflatten(tree, list(reduced))


