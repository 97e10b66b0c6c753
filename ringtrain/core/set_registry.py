"""The registry of process sets: which sets exist, which this rank belongs to, and their engines. The lowest layer
of process sets -- no collectives here: state.py stops the sets' engines through it, routing.py finds a
collective's engine in it, and process_sets.py (above the collectives) adds and removes sets with it.
"""
import dataclasses
import threading

from ..errors import RingtrainError

_lock = threading.Lock()
_members = {}       # process_set_id -> _Membership, for the sets this rank belongs to (world excluded)
_by_id = {}         # process_set_id -> ProcessSet, every registered set (world excluded)
_next_id = 1
_world = {"rank": None, "size": None}    # this process in the world, set by init()


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
        return _world["size"] if self.process_set_id == 0 else len(self.ranks)

    def rank(self):
        """This process's rank within the set (its index in `ranks`), or None when not registered or not a member."""
        if self.process_set_id is None:
            return None
        if self.process_set_id == 0:
            return _world["rank"]
        return self.ranks.index(_world["rank"]) if self.included() else None

    def included(self):
        """Whether this process belongs to the set (None before it is registered)."""
        if self.process_set_id is None:
            return None
        return self.process_set_id == 0 or _world["rank"] in self.ranks

    def _invalidate(self):
        self.process_set_id = None

    def __repr__(self):
        ranks = "all" if self.process_set_id == 0 else self.ranks
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={ranks})"


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


def set_world(rank, size):
    """init(): this process's world rank and size; the global set spans them."""
    _world.update(rank=rank, size=size)
    global_process_set.ranks = list(range(size))


@dataclasses.dataclass
class _Membership:
    comm: object
    topology: object
    engine: object


def lookup(set_id):
    """(registered ProcessSet or None, this rank's membership or None) of a set id."""
    with _lock:
        return _by_id.get(set_id), _members.get(set_id)


def next_id():
    with _lock:
        return _next_id


def create(process_set, everyone, world, config):
    """Register `process_set`, given the ranks every world rank asked for (everyone[r]: rank r's list, None
    where a rank holds a communicator it is not part of). Collective over `world`: splits the set's
    communicator and starts its engine on its members. Returns the registered ProcessSet."""
    global _next_id
    rank, size = _world["rank"], _world["size"]
    ranks = process_set.ranks
    if ranks is None:      # from a communicator: its members know the ranks, the others learn them here
        ranks = process_set.ranks = next((r for r in everyone if r is not None), [])
        everyone = [ranks if r is None else r for r in everyone]
    if not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < size for r in ranks):
        raise ValueError(f"process set ranks {ranks} must be distinct world ranks in 0..{size - 1}, at least one")
    if any(r != ranks for r in everyone):
        differing = {r: asked for r, asked in enumerate(everyone) if asked != everyone[0]}
        raise ValueError(f"add_process_set is collective and needs the same ranks on every rank: rank 0 asked for "
                         f"{everyone[0]}, but {differing}")
    with _lock:
        duplicate = [ps for ps in _by_id.values() if ps.ranks == ranks]
    if duplicate:
        raise ValueError(f"a process set with ranks {ranks} is already registered: {duplicate[0]!r}")
    _require_thread_multiple()
    member = rank in ranks
    # Split is collective over the world: non-members take part with MPI_UNDEFINED and get COMM_NULL
    from mpi4py import MPI
    comm = world.Split(color=0 if member else MPI.UNDEFINED, key=rank)
    membership = None
    if member:
        from ..engine.engine import Engine
        from ..topology import Topology
        topology = Topology(comm)
        # one timeline file per process: the world engine owns it
        membership = _Membership(comm, topology, Engine(topology, dataclasses.replace(config, timeline="")))
    with _lock:
        set_id = _next_id
        _next_id += 1
        process_set.process_set_id = set_id
        _by_id[set_id] = process_set
        if membership is not None:
            _members[set_id] = membership
    if membership is not None:
        membership.engine.observer.name_as(f"process set {set_id}")
    return process_set


def forget(set_id):
    """Unregister one set; returns (registered ProcessSet or None, this rank's membership or None)."""
    with _lock:
        registered = _by_id.pop(set_id, None) if set_id is not None else None
        membership = _members.pop(set_id, None)
    return registered, membership


def process_sets():
    """Every registered set, the global one first."""
    with _lock:
        return [global_process_set] + [_by_id[i] for i in sorted(_by_id)]


def member_engines():
    """(set id, engine) of every set this rank belongs to (world excluded), in id order."""
    with _lock:
        return [(i, _members[i].engine) for i in sorted(_members)]


def stop(membership):
    engine = membership.engine
    clean = engine.shutdown(timeout=max(engine.config.stall_timeout_s, 10.0))
    if clean and engine.failed is None:
        engine.close()
        membership.topology.free()
        membership.comm.Free()


def shutdown_all():
    """Called by ringtrain.shutdown() before the world engine stops: every set's engine, in id order (the same on
    every rank, so two ranks sharing several sets never wait on each other in different orders)."""
    for membership in _forget_all():
        stop(membership)


def abandon_all(error):
    """ringtrain.core.state.abandon(): every set's engine leaves its (dead) world without a collective call."""
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
