"""reducescatter and grouped_reducescatter: reduce over the set's ranks, keep this rank's block of dim 0.

    block = hvd.reducescatter(x)       # x of shape (n, ...) -> this rank's rows of the average, (n // size (+1), ...)

Blocks split dim 0 as evenly as possible, the first n % size blocks one row larger (the core's rule).
Gradient (Horovod's rule, ringtrain.reducer.gradient_rules): an allgather of the cotangent, times the set's size for Sum,
times the pre- and postscale factors.
"""
import dataclasses

import jax
from jax.core import ShapedArray

from ringtrain.core import collectives
from ringtrain.ops import Average, ReduceOp, resolve_op
from ringtrain.core.process_sets import ProcessSet, global_process_set

from . import gradients
from .arrays import Wire, check_reduction, check_scales
from .host_call import collective_primitive, differentiable
from .naming import collective_name


@dataclasses.dataclass(frozen=True)
class ReducescatterSpec:
    name: str
    op: ReduceOp
    prescale_factor: float
    postscale_factor: float
    process_set: ProcessSet

    def blocks(self, rows):
        n = self.process_set.size()
        return tuple(rows // n + (k < rows % n) for k in range(n))


def _run(*inputs, spec):
    wires = [Wire(a, spec.op) for a in inputs]
    for w in wires:
        check_scales(w, spec.prescale_factor, spec.postscale_factor, f"reducescatter {spec.name!r}")
    handles = [collectives.reducescatter_async(w.array, w.op, spec.name if len(wires) == 1 else f"{spec.name}.{i}",
                                         spec.process_set, spec.prescale_factor, spec.postscale_factor)
               for i, w in enumerate(wires)]
    size = spec.process_set.size()
    return [w.back(h.wait(), size) for w, h in zip(wires, handles)]


def _block_avals(*avals, spec):
    me = spec.process_set.rank()
    return [ShapedArray((spec.blocks(a.shape[0])[me],) + a.shape[1:], a.dtype) for a in avals]


def _backward(spec, rows, cotangents):
    return gradients.backward("reducescatter", cotangents, spec, gather_rows=tuple(spec.blocks(n) for n in rows),
                              op=spec.op, prescale_factor=spec.prescale_factor, postscale_factor=spec.postscale_factor)


reducescatter_p = collective_primitive("ringtrain_reducescatter", _run, _block_avals)
_reducescatter = differentiable(reducescatter_p, _backward, residual=lambda xs: tuple(x.shape[0] for x in xs))


def _scatter(kind, leaves, op, name, process_set, prescale_factor, postscale_factor):
    for x in leaves:
        if x.ndim == 0:
            raise ValueError(f"{kind} needs arrays with at least one dimension")
    spec = ReducescatterSpec(collective_name(kind, name, process_set), resolve_op(op, None), float(prescale_factor),
                             float(postscale_factor), process_set)
    for x in leaves:
        check_reduction(x.dtype, spec.op, f"{kind} {spec.name!r}")
    return list(_reducescatter(tuple(leaves), spec))


def reducescatter(tensor, op=Average, name=None, process_set=global_process_set, prescale_factor=1.0,
                  postscale_factor=1.0):
    """This rank's block of dim 0 of the reduction over the set's ranks. Differentiable."""
    return _scatter("reducescatter", [jax.numpy.asarray(tensor)], op, name, process_set, prescale_factor,
                    postscale_factor)[0]


def grouped_reducescatter(tensors, op=Average, name=None, process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0):
    """reducescatter of each array of a list (or pytree) in one host call; returns the same structure."""
    leaves, tree = jax.tree_util.tree_flatten(tensors)
    if not leaves:
        raise ValueError("grouped_reducescatter needs at least one array")
    return jax.tree_util.tree_unflatten(tree, _scatter("grouped_reducescatter", [jax.numpy.asarray(x) for x in leaves],
                                                       op, name, process_set, prescale_factor, postscale_factor))
