"""Horovod's gradients of the collectives (ringtrain.reducer.gradient_rules, the table every binding runs) on jax.Arrays.

Each collective's custom_vjp backward calls `backward(kind, cotangents, ...)`; the table decides which collective
runs on the cotangents and what is kept, and `JaxPrimitives` runs it with ringtrain.jax's own differentiable
collectives, so the backward pass is ordered and named like any other collective (`<forward name>.grad`).
Under tracing every rank's dim 0 of an allgather is equal (allgather.py checks it), so "this rank's rows" start at
rank x rows.
A collective's gradient is a collective: each primitive module registers its differentiable function here
(`register`) when it is imported, so this module imports none of them (no import circle).
"""
import jax
import jax.numpy as jnp

from ringtrain.reducer import gradient_rules

_differentiable = {}      # kind -> (Spec class, the differentiable function), registered by allreduce.py & co.


def register(kind, spec_class, function):
    _differentiable[kind] = (spec_class, function)


class JaxPrimitives(gradient_rules.Primitives):
    def __init__(self, gather_rows=None):
        self.gather_rows = gather_rows        # per cotangent, per rank: dim 0 for a backward allgather

    def allreduce(self, grads, op, prescale_factor, postscale_factor, process_set, name):
        spec_class, allreduce = _differentiable["allreduce"]
        return list(allreduce(tuple(grads), spec_class(name, op, prescale_factor, postscale_factor, process_set)))

    def allgather(self, grads, process_set, name):
        spec_class, allgather = _differentiable["allgather"]
        return list(allgather(tuple(grads), spec_class(name, process_set, self.gather_rows)))

    def alltoall(self, grad, splits, process_set, name):
        spec_class, alltoall = _differentiable["alltoall"]
        return alltoall(grad, spec_class(name, process_set))

    def rows_of_rank(self, grad, rows, process_set, name):
        start = process_set.rank() * rows
        return jax.lax.slice_in_dim(grad, start, start + rows)

    def zeros_like(self, grad):
        return jnp.zeros_like(grad)

    def scale(self, grad, factor):
        return grad * jnp.asarray(factor, grad.dtype)


def backward(kind, cotangents, spec, gather_rows=None, **forward):
    """The cotangents of a collective's inputs, by Horovod's rule for `kind`, as one tuple."""
    return tuple(gradient_rules.backward(kind, list(cotangents), JaxPrimitives(gather_rows),
                                         process_set=spec.process_set, name=spec.name + ".grad", **forward))
