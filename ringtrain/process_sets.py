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
"""
import dataclasses
import threading

from . import state
from .errors import RingtrainError

_lock = threading.Lock()
_members = {}       # process_set_id -> _Membership, for the sets this rank belongs to (world excluded)
_by_id = {}         # process_set_id -> ProcessSet, every registered set (world excluded)
_next_id = 1
_world_route = None  # the Route of the world's current engine


class ProcessSet:
    """A set of world ranks that run collectives together. Pass it to init(process_sets=[...]) or
    add_process_set(), then as `process_set=` to any collective."""

    def __init__(self, ranks_or_comm):
        self.process_set_id = None
        self.mpi_comm = None
        if hasattr(ranks_or_comm, "Get_group"):           # an mpi4py communicator: its ranks are found at add time
            self.mpi_comm = ranks_or_comm
            self.ranks = None
            return
        try:
            ranks = list(ranks_or_comm)
        except TypeError:
            raise ValueError("ProcessSet takes a list of world ranks or an mpi4py communicator, got "
                             f"{type(ranks_or_comm).__name__}") from None
        if any(isinstance(r, bool) or not isinstance(r, int) for r in ranks):
            raise ValueError(f"ProcessSet ranks must be ints, got {ranks!r}")
        self.ranks = sorted(ranks)

    def size(self):
        """Number of ranks in the set, or None before it is registered."""
        if self.process_set_id is None:
            return None
        return state.size() if self.process_set_id == 0 else len(self.ranks)

    def rank(self):
        """This process's rank within the set (its index in `ranks`), or None when not registered or not a member."""
        if self.process_set_id is None:
            return None
        if self.process_set_id == 0:
            return state.rank()
        return self.ranks.index(state.rank()) if self.included() else None

    def included(self):
        """Whether this process belongs to the set (None before it is registered)."""
        if self.process_set_id is None:
            return None
        return self.process_set_id == 0 or state.rank() in self.ranks

    def _invalidate(self):
        self.process_set_id = None

    def __repr__(self):
        ranks = "all" if self.process_set_id == 0 else self.ranks
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={ranks})"


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


@dataclasses.dataclass
class _Membership:
    comm: object
    topology: object
    engine: object


@dataclasses.dataclass(frozen=True)
class Route:
    """Where a collective on a process set goes: its engine, this rank's rank in it, its size, its world ranks."""
    engine: object
    rank: int
    size: int
    ranks: tuple
    process_set_id: int

    def set_rank(self, world_rank, what):
        """A world rank (Horovod's root_rank convention) as a rank within the set; ValueError if not a member."""
        if self.process_set_id == 0:
            return world_rank
        if world_rank not in self.ranks:
            raise ValueError(f"{what}: root_rank {world_rank} is not in process set {self.process_set_id} "
                             f"(ranks {list(self.ranks)}); root_rank is a world rank and must belong to the set")
        return self.ranks.index(world_rank)


def route(process_set):
    """The Route of a collective on `process_set` (None = the world). Raises, on this rank only and before
    anything is sent, when this rank is not a member or the set is not (or no longer) registered."""
    global _world_route
    if process_set is None or process_set is global_process_set or getattr(process_set, "process_set_id", -1) == 0:
        engine = state.engine()
        world = _world_route           # cached: every world collective passes here (one per gradient bucket part)
        if world is None or world.engine is not engine:
            world = _world_route = Route(engine, state.rank(), state.size(), (), 0)
        return world
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a ProcessSet, got {type(process_set).__name__}")
    state.engine()      # NotInitializedError first, when that is the problem
    set_id = process_set.process_set_id
    with _lock:
        registered = _by_id.get(set_id)
        membership = _members.get(set_id)
    if set_id is None or registered is None:
        raise ValueError(f"{process_set!r} is not registered: pass it to init(process_sets=...) or "
                         "add_process_set() first (or it was removed)")
    if membership is None:
        raise ValueError(f"rank {state.rank()} is not a member of process set {set_id} (ranks {registered.ranks}); "
                         "only its members may call collectives on it (check process_set.included() first)")
    ranks = tuple(registered.ranks)
    return Route(membership.engine, ranks.index(state.rank()), len(ranks), ranks, set_id)


def add_process_set(process_set):
    """Register a process set; collective: every rank of the world calls it, with the same ranks, in the same order
    as its other add/remove calls. Accepts a ProcessSet or a list of world ranks; returns the registered ProcessSet."""
    global _next_id
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.process_set_id is not None:
        raise ValueError(f"{process_set!r} is already registered")
    from .collectives import allgather_object
    world = state.topology().world
    ranks = process_set.ranks
    if ranks is None:      # from a communicator: its members know the ranks, the others learn them below
        ranks = _world_ranks_of(process_set.mpi_comm, world)
    # every rank must ask for the same set, or the communicator split below would silently build different ones
    everyone = allgather_object(ranks, name=f"add_process_set.{_next_id}")
    if process_set.ranks is None:
        ranks = process_set.ranks = next((r for r in everyone if r is not None), [])
        everyone = [ranks if r is None else r for r in everyone]
    size = state.size()
    if not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < size for r in ranks):
        raise ValueError(f"process set ranks {ranks} must be distinct world ranks in 0..{size - 1}, at least one")
    if any(r != ranks for r in everyone):
        differing = {rank: r for rank, r in enumerate(everyone) if r != everyone[0]}
        raise ValueError(f"add_process_set is collective and needs the same ranks on every rank: rank 0 asked for "
                         f"{everyone[0]}, but {differing}")
    with _lock:
        duplicate = [ps for ps in _by_id.values() if ps.ranks == ranks]
    if duplicate:
        raise ValueError(f"a process set with ranks {ranks} is already registered: {duplicate[0]!r}")
    _require_thread_multiple()
    member = state.rank() in ranks
    # Split is collective over the world: non-members take part with MPI_UNDEFINED and get COMM_NULL
    from mpi4py import MPI
    comm = world.Split(color=0 if member else MPI.UNDEFINED, key=state.rank())
    membership = None
    if member:
        from .engine import Engine
        from .topology import Topology
        topology = Topology(comm)
        # one timeline file per process: the world engine owns it
        config = dataclasses.replace(state.config(), timeline="")
        membership = _Membership(comm, topology, Engine(topology, config))
    with _lock:
        set_id = _next_id
        _next_id += 1
        process_set.process_set_id = set_id
        _by_id[set_id] = process_set
        if membership is not None:
            _members[set_id] = membership
    return process_set


def remove_process_set(process_set):
    """Unregister a process set and stop its engine; collective over the world like add_process_set.
    Returns False for the global set (which cannot be removed), True otherwise."""
    set_id = getattr(process_set, "process_set_id", None)
    if set_id == 0:
        return False
    with _lock:
        registered = _by_id.pop(set_id, None) if set_id is not None else None
        membership = _members.pop(set_id, None)
    if registered is None:
        raise ValueError(f"{process_set!r} is not registered")
    registered._invalidate()
    process_set._invalidate()
    if membership is not None:
        _stop(membership)
    from .collectives import barrier
    barrier(name=f"remove_process_set.{set_id}")
    return True


def process_sets():
    """Every registered set, the global one first."""
    with _lock:
        return [global_process_set] + [_by_id[i] for i in sorted(_by_id)]


def _stop(membership):
    engine = membership.engine
    clean = engine.shutdown(timeout=max(state.config().stall_timeout_s, 10.0))
    if clean and engine.failed is None:
        engine.close()
        membership.topology.free()
        membership.comm.Free()


def shutdown_all():
    """Called by ringtrain.shutdown() before the world engine stops: every set's engine, in id order (the same on
    every rank, so two ranks sharing several sets never wait on each other in different orders)."""
    for membership in _forget_all():
        _stop(membership)


def abandon_all(error):
    """ringtrain.state.abandon(): every set's engine leaves its (dead) world without a collective call."""
    members = _forget_all()
    for membership in members:
        membership.engine.abandon(error)


def _forget_all():
    """Unregister every set (world excluded) and return the memberships whose engines are still running."""
    global _next_id
    with _lock:
        members = [_members[i] for i in sorted(_members)]
        registered = list(_by_id.values())
        _members.clear()
        _by_id.clear()
        _next_id = 1
    for process_set in registered:
        process_set._invalidate()
    return members


def _world_ranks_of(comm, world):
    """World ranks of a communicator's (or window's) members (None on a rank that holds MPI.COMM_NULL)."""
    from mpi4py import MPI
    if comm == MPI.COMM_NULL:
        return None
    group, world_group = comm.Get_group(), world.Get_group()
    try:
        return sorted(MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world_group))
    finally:
        group.Free()
        world_group.Free()


def _require_thread_multiple():
    from mpi4py import MPI
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise RingtrainError("process sets need MPI_THREAD_MULTIPLE (each set's engine thread calls MPI while the "
                             "world's does); initialise MPI with MPI.Init_thread(MPI.THREAD_MULTIPLE) or let "
                             "ringtrain.init() do it")
