"""Process sets: collectives among a subset of the ranks, as in Horovod.

    evens = rt.add_process_set([0, 2])                  # collective: every rank calls it with the same ranks
    if evens.included():
        rt.allreduce(x, process_set=evens)              # only ranks 0 and 2 take part
    rt.remove_process_set(evens)                         # collective again

Each set has its own communicator (split from the world, collectively) and its own Engine on it: its own thread,
transports (a shared-memory window among the set's ranks of one node) and agreement (rank 0 *of the set*
coordinates). So collectives of disjoint sets run concurrently, and mismatch and stall detection work inside a set.

Conventions follow Horovod: `ranks` are world ranks, sorted; a broadcast's `root_rank` is a world rank (it must
belong to the set); allgather, alltoall and reducescatter order their blocks by rank within the set.
global_process_set (id 0) is the world and is always there.

Layers: the registry of sets (set_registry.py) and routing (routing.py) sit below the collectives; adding and
removing a set, which runs collectives to agree on it, sits here, above them.
"""
from . import set_registry, state
from .collectives import allgather_object, barrier
from .routing import route  # noqa: F401  (bindings reach routing through here)
from .set_registry import (ProcessSet, _world_ranks_of, global_process_set,  # noqa: F401  (the public names)
                           process_sets)


def add_process_set(process_set) -> "ProcessSet":
    """Register a process set; collective: every rank of the world calls it, with the same ranks, in the same order
    as its other add/remove calls. Accepts a ProcessSet or a list of world ranks; returns the registered ProcessSet."""
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.process_set_id is not None:
        raise ValueError(f"{process_set!r} is already registered")
    world = state.topology().world
    ranks = process_set.ranks
    if ranks is None:      # from a communicator: its members know the ranks, the others learn them below
        ranks = _world_ranks_of(process_set.mpi_comm, world)
    # every rank must ask for the same set, or the communicator split would silently build different ones
    everyone = allgather_object(ranks, name=f"add_process_set.{set_registry.next_id()}")
    return set_registry.create(process_set, everyone, world, state.config())


def remove_process_set(process_set) -> None:
    """Unregister a process set and stop its engine; collective over the world like add_process_set.
    Returns False for the global set (which cannot be removed), True otherwise."""
    set_id = getattr(process_set, "process_set_id", None)
    if set_id == 0:
        return False
    registered, membership = set_registry.forget(set_id)
    if registered is None:
        raise ValueError(f"{process_set!r} is not registered")
    registered._invalidate()
    process_set._invalidate()
    if membership is not None:
        set_registry.stop(membership)
    barrier(name=f"remove_process_set.{set_id}")
    return True
