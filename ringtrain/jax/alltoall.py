"""alltoall: rank i sends block j of its dim 0 to rank j and receives every rank's block i, in rank order.

    out = hvd.alltoall(x)                                  # dim 0 split evenly, eagerly or under jax.jit
    out, received_splits = hvd.alltoall(x, splits=[1, 3])  # uneven splits: eagerly only

Under jax.jit or jax.grad the result's shape must be known when tracing, so only even splits are allowed there:
every rank's dim 0 must be the same multiple of the set's size (a rank that receives other block sizes raises
TensorMismatchError naming them).
Gradient (Horovod's rule, ringtrain.reducer.gradient_rules): the reverse alltoall of the cotangent.
"""
import dataclasses

import jax
import numpy as np

from ringtrain.core import collectives
from ringtrain.errors import TensorMismatchError
from ringtrain.core.process_sets import ProcessSet, global_process_set

from . import arrays, gradients
from .allgather import is_traced
from .arrays import Wire, check_movable
from .host_call import collective_primitive, differentiable, same_avals
from .naming import collective_name


@dataclasses.dataclass(frozen=True)
class AlltoallSpec:
    name: str
    process_set: ProcessSet
    splits: tuple = None       # eagerly: what this rank sends to each rank (None: even)


def _exchange(array, spec):
    wire = Wire(array)
    received, received_splits = collectives.alltoall(wire.array, spec.splits, spec.name, process_set=spec.process_set)
    return wire.back(received), np.asarray(received_splits)


def _run_even(array, spec):
    received, received_splits = _exchange(array, spec)
    if received.shape != array.shape:
        raise TensorMismatchError(f"alltoall {spec.name!r}: under jit every rank must send equal blocks of the same "
                                  f"size; this rank (rank {spec.process_set.rank()}) sent {array.shape[0]} rows and "
                                  f"received blocks of {received_splits.tolist()} rows")
    return [received]


def _backward(spec, _, cotangents):
    return gradients.backward("alltoall", cotangents, spec)


alltoall_p = collective_primitive("ringtrain_alltoall", _run_even, same_avals)
_alltoall_one = differentiable(alltoall_p, _backward)


def _alltoall(x, spec):
    return _alltoall_one((x,), spec)[0]
gradients.register("alltoall", AlltoallSpec, _alltoall)


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Send splits[j] rows of `tensor` to rank j of the set (even split when None). Returns the received array
    alone when splits is None, else (received array, received splits) -- Horovod's convention. Differentiable
    (even splits)."""
    name = collective_name("alltoall", name, process_set)
    tensor = jax.numpy.asarray(tensor)
    if np.ndim(tensor) == 0:
        raise ValueError("alltoall needs an array with at least one dimension")
    check_movable(tensor.dtype, f"alltoall {name!r}")
    if is_traced([tensor]):
        if splits is not None:
            raise ValueError(f"alltoall {name!r}: splits= needs the result's shape after the call; under jax.jit "
                             "or jax.grad only even splits (splits=None) are supported")
        n = process_set.size()
        if tensor.shape[0] % n:
            raise ValueError(f"alltoall without splits needs dim 0 ({tensor.shape[0]}) divisible by size ({n})")
        return _alltoall(tensor, AlltoallSpec(name, process_set))
    spec = AlltoallSpec(name, process_set, None if splits is None else tuple(int(s) for s in np.ravel(splits)))
    received, received_splits = _exchange(arrays.to_numpy(tensor), spec)
    if splits is None:
        return arrays.to_jax(received)
    return arrays.to_jax(received), jax.numpy.asarray(received_splits)
