"""allgather and grouped_allgather: every rank's array concatenated along dim 0, in rank order (within the set).

    rows = hvd.allgather(x)            # x of shape (k, ...) on each rank -> (size * k, ...)

Eagerly each rank's dim 0 may differ (the result's size is known after the call). Under jax.jit or jax.grad the
result's shape must be known when tracing, so every rank's dim 0 must equal this rank's (as in mpi4jax and
jax.lax.all_gather); each rank sends its row counts beside the data and every rank raises the same
TensorMismatchError, naming the ranks and their rows, when they differ.

Gradient (Horovod's rule, ringtrain.reducer.gradient_rules): this rank's rows of the cotangent averaged over the set's ranks.
"""
import dataclasses

import jax
import numpy as np
from jax.core import ShapedArray

from ringtrain.core import collectives
from ringtrain.errors import TensorMismatchError
from ringtrain.core.process_sets import ProcessSet, global_process_set

from . import arrays, gradients
from .arrays import Wire, check_movable
from .host_call import collective_primitive, differentiable
from .naming import collective_name


@dataclasses.dataclass(frozen=True)
class AllgatherSpec:
    name: str
    process_set: ProcessSet
    rows: tuple = None      # per array, per rank of the set: dim 0 as declared when tracing (None: eagerly, any)


def _run(*inputs, spec):
    wires = [Wire(a) for a in inputs]
    parts = [w.array for w in wires]
    if spec.rows is not None:          # the row counts travel with the data: every rank checks every rank's
        parts.append(np.array([a.shape[0] for a in inputs], np.int64))
    gathered = collectives.grouped_allgather(parts, spec.name, spec.process_set)
    if spec.rows is not None:
        _check_rows(spec, gathered.pop().reshape(-1, len(inputs)))
    return [w.back(g) for w, g in zip(wires, gathered)]


def _check_rows(spec, rows_by_rank):
    expected = np.array(spec.rows, np.int64).T             # (ranks, arrays)
    if np.array_equal(rows_by_rank, expected):
        return
    have = ", ".join(f"rank {r} has {list(rows)}" for r, rows in enumerate(rows_by_rank.tolist()))
    raise TensorMismatchError(f"allgather {spec.name!r}: under jit every rank's dim 0 must match (rows per array: "
                              f"{have}); gather arrays of different lengths outside jit, or pad them")


def _gathered_avals(*avals, spec):
    return [ShapedArray((sum(rows),) + a.shape[1:], a.dtype) for a, rows in zip(avals, spec.rows)]


def _backward(spec, _, cotangents):
    me = spec.process_set.rank()
    return gradients.backward("allgather", cotangents, spec, rows=[rows[me] for rows in spec.rows])


allgather_p = collective_primitive("ringtrain_allgather", _run, _gathered_avals)
_allgather = differentiable(allgather_p, _backward)
gradients.register("allgather", AllgatherSpec, _allgather)


def is_traced(leaves):
    return any(isinstance(x, jax.core.Tracer) for x in leaves)


def gather(leaves, name, process_set, rows=None):
    """Differentiable allgather of a list of arrays; `rows` (per array, per rank) as declared when tracing."""
    for x in leaves:
        if np.ndim(x) == 0:
            raise ValueError("allgather needs arrays with at least one dimension")
        check_movable(x.dtype, f"allgather {name!r}")
    if not is_traced(leaves):
        return [arrays.to_jax(r) for r in _run(*[arrays.to_numpy(x) for x in leaves],
                                               spec=AllgatherSpec(name, process_set))]
    if rows is None:
        rows = tuple((x.shape[0],) * process_set.size() for x in leaves)
    return list(_allgather(tuple(leaves), AllgatherSpec(name, process_set, rows)))


def allgather(tensor, name=None, process_set=global_process_set):
    """Concatenate every rank's `tensor` along dim 0, in rank order. Differentiable."""
    (gathered,) = gather([jax.numpy.asarray(tensor)], collective_name("allgather", name, process_set), process_set)
    return gathered


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """allgather of each array of a list (or pytree) in one host call; returns the same structure."""
    leaves, tree = jax.tree_util.tree_flatten(tensors)
    if not leaves:
        raise ValueError("grouped_allgather needs at least one array")
    gathered = gather([jax.numpy.asarray(x) for x in leaves],
                      collective_name("grouped_allgather", name, process_set), process_set)
    return jax.tree_util.tree_unflatten(tree, gathered)
