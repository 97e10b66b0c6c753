"""Where a collective goes: the engine of its process set (the world's by default) and this rank's place in it.
Below the collectives, above the process-wide state and the set registry."""
import dataclasses

from . import set_registry, state
from .set_registry import ProcessSet, global_process_set

_world_route = None  # the Route of the world's current engine


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
        current = state._state        # (the module's own state: two calls fewer than state.engine() on every call)
        engine = current[1] if current is not None else state.engine()      # (the latter raises)
        world = _world_route           # cached: every world collective passes here (one per gradient bucket part)
        if world is None or world.engine is not engine:
            world = _world_route = Route(engine, state.rank(), state.size(), (), 0)
        return world
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a ProcessSet, got {type(process_set).__name__}")
    state.engine()      # NotInitializedError first, when that is the problem
    set_id = process_set.process_set_id
    registered, membership = set_registry.lookup(set_id)
    if set_id is None or registered is None:
        raise ValueError(f"{process_set!r} is not registered: pass it to init(process_sets=...) or "
                         "add_process_set() first (or it was removed)")
    if membership is None:
        raise ValueError(f"rank {state.rank()} is not a member of process set {set_id} (ranks {registered.ranks}); "
                         "only its members may call collectives on it (check process_set.included() first)")
    ranks = tuple(registered.ranks)
    return Route(membership.engine, ranks.index(state.rank()), len(ranks), ranks, set_id)
