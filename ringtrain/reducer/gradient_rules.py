"""Horovod's gradients of the collectives, as one table that torch autograd and TensorFlow's gradients both run.

Each rule says which collective the backward pass runs on the output gradient, with which op and scale factors,
what it multiplies the result by, and which part of it this rank keeps (each rank's loss is its own):

    collective       backward runs                               then
    allreduce        allreduce, same op and pre/post scales      -
    allgather        allreduce, Average                          this rank's rows
    broadcast        allreduce, Average                          the root keeps it, other ranks get zeros
    alltoall         alltoall back, with the received splits     -
    reducescatter    allgather                                   x set size for Sum, x prescale x postscale

A binding implements `Primitives` (its own differentiable collectives on its tensors) and calls
`backward(kind, grads, primitives, ...)` from its autograd function or custom gradient; the grouped forms pass lists.
"""
import dataclasses
import enum

from ringtrain.core import state
from ringtrain.ops import Average, Sum, as_allreduce_op, as_op


class Backward(enum.Enum):
    ALLREDUCE = "allreduce"
    ALLGATHER = "allgather"
    ALLTOALL = "alltoall"


class Keep(enum.Enum):
    ALL = "all"                  # the whole result
    MY_ROWS = "my rows"          # the rows this rank contributed to the forward allgather
    ROOT_ONLY = "root only"      # the broadcast's root keeps the result, the others get zeros


def _set_size_for_sum(op, set_size, prescale_factor, postscale_factor):
    return (set_size if op == Sum else 1) * prescale_factor * postscale_factor


@dataclasses.dataclass(frozen=True)
class GradientRule:
    runs: Backward
    op: object = None                   # the backward collective's op; None: the forward's op and scale factors
    keep: Keep = Keep.ALL
    factor: object = None               # factor(op, set_size, prescale, postscale) multiplying the result
    defined_for: tuple = ()             # forward ops with a gradient; () = every op

    def check(self, kind, op):
        if self.defined_for and op not in self.defined_for:
            names = " or ".join(o.name.title() for o in self.defined_for)
            raise NotImplementedError(f"{kind} with op={op.name.title()} has no gradient (only {names})")


RULES = {
    "allreduce": GradientRule(Backward.ALLREDUCE),
    "allgather": GradientRule(Backward.ALLREDUCE, op=Average, keep=Keep.MY_ROWS),
    "broadcast": GradientRule(Backward.ALLREDUCE, op=Average, keep=Keep.ROOT_ONLY),
    "alltoall": GradientRule(Backward.ALLTOALL),
    "reducescatter": GradientRule(Backward.ALLGATHER, factor=_set_size_for_sum, defined_for=(Average, Sum)),
}


class Primitives:
    """What a binding provides: collectives on lists of its tensors (differentiable ones where it wants double
    backward), and three tensor operations."""

    def allreduce(self, grads, op, prescale_factor, postscale_factor, process_set, name):
        raise NotImplementedError

    def allgather(self, grads, process_set, name):
        raise NotImplementedError

    def alltoall(self, grad, splits, process_set, name):
        raise NotImplementedError

    def rows_of_rank(self, grad, rows, process_set, name):
        """The rows of `grad` (dim 0) this rank contributed, `rows` of them, in the set's rank order."""
        raise NotImplementedError

    def zeros_like(self, grad):
        raise NotImplementedError

    def scale(self, grad, factor):
        raise NotImplementedError


def backward(kind, grads, primitives, *, process_set, op=Average, prescale_factor=1.0, postscale_factor=1.0,
             root_rank=0, rows=None, splits=None, name=None):
    """Gradients of the inputs of collective `kind` from the gradients of its outputs (lists, one per tensor).
    rows: each input's dim 0 (allgather); splits: the forward's received splits (alltoall); root_rank: a world
    rank (broadcast); op and the scale factors: the forward's."""
    rule = RULES[kind]
    op = as_allreduce_op(op) if kind == "allreduce" else as_op(op)     # Adasum's gradient: the Adasum of gradients
    rule.check(kind, op)
    grads = list(grads)
    # a binding may name each tensor's backward collectives (TensorFlow's host calls); list calls get the list
    names = list(name) if isinstance(name, (list, tuple)) else [name] * len(grads)
    name = names if isinstance(name, (list, tuple)) else name
    if rule.runs is Backward.ALLREDUCE:
        if rule.op is None:
            out = primitives.allreduce(grads, op, prescale_factor, postscale_factor, process_set, name)
        else:
            out = primitives.allreduce(grads, rule.op, 1.0, 1.0, process_set, name)
    elif rule.runs is Backward.ALLGATHER:
        out = primitives.allgather(grads, process_set, name)
    else:
        out = [primitives.alltoall(grad, splits, process_set, n) for grad, n in zip(grads, names)]
    if rule.factor is not None:
        set_size = process_set.size() if process_set is not None else state.size()
        factor = rule.factor(op, set_size, prescale_factor, postscale_factor)
        if factor != 1:
            out = [primitives.scale(g, factor) for g in out]
    if rule.keep is Keep.MY_ROWS:
        out = [primitives.rows_of_rank(g, r, process_set, n) for g, r, n in zip(out, rows, names)]
    elif rule.keep is Keep.ROOT_ONLY and state.rank() != root_rank:
        out = [primitives.zeros_like(g) for g in out]
    return out
