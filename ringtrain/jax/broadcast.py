"""broadcast and broadcast_variables: root_rank's arrays on every rank of the set.

    params = hvd.broadcast_variables(params, root_rank=0)     # any pytree: one host call, one request per leaf

root_rank is a world rank (Horovod's convention, process sets included).
Gradient (Horovod's rule, ringtrain.reducer.gradient_rules): the cotangent averaged over the set's ranks on the root, zeros on the other ranks.
"""
import dataclasses

import jax

from ringtrain.core import collectives, state
from ringtrain.core.process_sets import ProcessSet, global_process_set

from . import gradients
from .arrays import Wire, check_movable
from .host_call import collective_primitive, differentiable, same_avals
from .naming import collective_name


@dataclasses.dataclass(frozen=True)
class BroadcastSpec:
    name: str
    root_rank: int
    process_set: ProcessSet


def _run(*inputs, spec):
    wires = [Wire(a) for a in inputs]
    names = [spec.name] if len(wires) == 1 else [f"{spec.name}.{i}" for i in range(len(wires))]
    handles = [collectives.broadcast_async(w.array, spec.root_rank, n, process_set=spec.process_set)
               for w, n in zip(wires, names)]
    return [w.back(h.wait()) for w, h in zip(wires, handles)]


def _backward(spec, _, cotangents):
    return gradients.backward("broadcast", cotangents, spec, root_rank=spec.root_rank)


broadcast_p = collective_primitive("ringtrain_broadcast", _run, same_avals)
_broadcast = differentiable(broadcast_p, _backward)


def _checked(leaves, what):
    leaves = [jax.numpy.asarray(x) for x in leaves]
    for x in leaves:
        check_movable(x.dtype, what)
    return tuple(leaves)


def _check_root(root_rank, what):
    if not isinstance(root_rank, int) or isinstance(root_rank, bool):
        raise TypeError(f"{what}: root_rank must be an int, got {root_rank!r}")
    if not 0 <= root_rank < state.size():
        raise ValueError(f"{what}: root_rank {root_rank} is out of range for {state.size()} ranks")
    return root_rank


def broadcast(tensor, root_rank=0, name=None, process_set=global_process_set):
    """root_rank's `tensor` on every rank of the set. Differentiable."""
    spec = BroadcastSpec(collective_name("broadcast", name, process_set), _check_root(root_rank, "broadcast"),
                         process_set)
    (result,) = _broadcast(_checked([tensor], f"broadcast {spec.name!r}"), spec)
    return result


def broadcast_variables(variables, root_rank=0, name=None, process_set=global_process_set):
    """root_rank's pytree of arrays (model parameters, optimizer state) on every rank: the same structure, in one
    host call. Non-array leaves are not allowed (broadcast_object covers Python objects)."""
    leaves, tree = jax.tree_util.tree_flatten(variables)
    if not leaves:
        return variables
    spec = BroadcastSpec(collective_name("broadcast_variables", name, process_set),
                         _check_root(root_rank, "broadcast_variables"), process_set)
    return jax.tree_util.tree_unflatten(tree, list(_broadcast(_checked(leaves, f"broadcast_variables {spec.name!r}"),
                                                                    spec)))
