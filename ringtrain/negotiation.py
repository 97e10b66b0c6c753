"""Agreement across ranks on which collectives are ready, decided by rank 0 (pure logic: no MPI here).

Every rank tells the coordinator (rank 0) the requests it has queued: the full metadata the first time a name is seen,
then only a small integer cache id while the metadata stays the same (the steady-state fast path: a training step sends a
list of ints, not shapes and dtypes). The coordinator answers with an ordered list of actions that every rank executes
in the same order, which is what makes out-of-order submission safe and deadlock-free.
"""
import collections
import dataclasses
import time

from .ops import DTYPES
from .response_cache import ResponseCache

CACHE_CAPACITY = 1024         # Horovod's default (RINGTRAIN_CACHE_CAPACITY)


@dataclasses.dataclass(frozen=True)
class Meta:
    """What every rank must agree on for one named collective."""
    kind: str                 # allreduce | allgather | broadcast | alltoall | reducescatter | barrier
    dtype: str = "uint8"
    shape: tuple = ()
    op: int = -1              # ReduceOp value, -1 where not a reduction
    root: int = -1
    device: str = "cpu"
    scales: tuple = (1.0, 1.0)   # prescale, postscale
    splits: tuple = ()        # alltoall: rows sent to each rank
    parts: tuple = ()         # grouped allreduce: element count of each tensor (shape is their total)

    @property
    def nbytes(self):
        n = 1
        for d in self.shape:
            n *= d
        return n * DTYPES[self.dtype].itemsize

    def describe(self):
        parts = [f"shape {self.shape} {self.dtype}"]
        if self.op >= 0:
            from .ops import ReduceOp
            parts.append(f"op {ReduceOp(self.op).name.title()}")
        if self.root >= 0:
            parts.append(f"root {self.root}")
        if self.kind == "alltoall":
            parts.append(f"splits {list(self.splits)}")
        if self.device != "cpu":
            parts.append(f"on {self.device}")
        if self.scales != (1.0, 1.0):
            parts.append(f"scales {self.scales}")
        if self.parts:
            parts.append(f"in {len(self.parts)} tensors")
        return f"{self.kind} " + " ".join(parts)


def _agreement_key(meta):
    """The part of the metadata that must be identical on every rank (allgather/alltoall may differ in dim 0)."""
    shape = meta.shape[1:] if meta.kind in ("allgather", "alltoall") else meta.shape
    return (meta.kind, meta.dtype, shape, meta.op, meta.root, meta.device, meta.scales, meta.parts)


# kinds whose metadata is the same on every rank: a cache id then names the same collective everywhere, which is
# what lets ranks agree on them without the coordinator (allgather/alltoall differ per rank in dim 0 / splits)
SAME_EVERYWHERE = frozenset(("allreduce", "broadcast", "reducescatter", "barrier"))


@dataclasses.dataclass(frozen=True)
class Action:
    """One step every rank executes, in the same order: a collective, or an error/warning/join/shutdown event."""
    kind: str                 # a collective kind, or error | warn | abort | join_done | shutdown
    names: tuple = ()         # the tensors it covers (an allreduce bucket may cover many)
    metas: tuple = ()         # their metadata, same order
    extra: tuple = ()         # allgather: dim 0 per rank; alltoall: splits per rank
    message: str = ""         # error / warn / abort text
    error: str = ""           # errors: the ringtrain.errors class name
    rank: int = -1            # join_done: the rank that joined last


def fusion_key(meta):
    """Allreduces fuse into one bucket only when they reduce the same way."""
    return (meta.dtype, meta.op, meta.device, meta.scales)


def fuse_allreduces(named_metas, threshold):
    """[(name, meta)] in execution order -> allreduce Actions, each one bucket of <= threshold bytes (a single
    larger tensor gets a bucket of its own). Pure and deterministic: every rank that runs it on the same list gets
    the same buckets, which is what the coordinator-free fast path relies on."""
    open_buckets = {}                        # fusion key -> [names, metas, bytes], in order of first use
    actions = []
    for name, meta in named_metas:
        key = fusion_key(meta)
        bucket = open_buckets.get(key)
        if bucket is not None and bucket[2] + meta.nbytes > threshold:
            actions.append(Action("allreduce", tuple(bucket[0]), tuple(bucket[1])))
            del open_buckets[key]
            bucket = None
        if bucket is None:
            bucket = open_buckets[key] = [[], [], 0]
        bucket[0].append(name)
        bucket[1].append(meta)
        bucket[2] += meta.nbytes
    actions.extend(Action("allreduce", tuple(names), tuple(metas)) for names, metas, _ in open_buckets.values())
    return actions


def _rank_list(ranks):
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))


def mismatch_message(name, metas):
    """'tensor 'w': rank 0 has allreduce shape (3,) float32 op Sum; rank 1 has allreduce shape (4,) float32 op Sum'."""
    groups = collections.defaultdict(list)
    for rank, meta in sorted(metas.items()):
        groups[meta.describe() if meta.kind not in ("allgather", "alltoall")
               else f"{meta.kind} shape (*, {', '.join(map(str, meta.shape[1:]))}) {meta.dtype}"
               + (f" root {meta.root}" if meta.root >= 0 else "")].append(rank)
    sides = [f"{_rank_list(ranks)} {'has' if len(ranks) == 1 else 'have'} {desc}" for desc, ranks in groups.items()]
    return f"tensor {name!r} differs across ranks: " + "; ".join(sides)


@dataclasses.dataclass
class _Entry:
    metas: dict
    first_seen: float
    warned: bool = False


class Coordinator:
    """Rank 0's book of submitted requests. Feed it submissions; `plan()` returns the actions to broadcast."""

    def __init__(self, size, fusion_threshold, stall_warning_s, stall_timeout_s, clock=time.monotonic,
                 cache_capacity=CACHE_CAPACITY, synchronous=True):
        """synchronous: every rank applies each cache update before it names an id again (the cycle agreement's
        slow cycles); otherwise submissions carry how many updates their sender applied (see response_cache)."""
        self.size = size
        self.fusion_threshold = fusion_threshold
        self.stall_warning_s = stall_warning_s
        self.stall_timeout_s = stall_timeout_s
        self.clock = clock
        self.pending = collections.OrderedDict()   # name -> _Entry, in order of first submission
        self.joined = {}                           # rank -> order of joining
        self.shut_down = set()
        self.cache = ResponseCache(cache_capacity, synchronous)
        self._acknowledged = {r: 0 for r in range(1, size)}   # cache updates each other rank has applied

    # ---- input ---------------------------------------------------------------------------------------
    def submit(self, rank, items, updates=None):
        """items: list of (name, Meta) or int cache ids; updates: how many cache updates the sender had applied
        when it named those ids (the coordinator protocol; None in a slow cycle, where every rank applied all)."""
        lookup = self.cache.lookup
        for item in items:
            name, meta = lookup(item) if isinstance(item, int) else item
            entry = self.pending.get(name)
            if entry is None:
                entry = self.pending[name] = _Entry({}, self.clock())
            entry.metas[rank] = meta
        if updates is not None and rank in self._acknowledged:
            self._acknowledged[rank] = updates
            self.cache.release(min(self._acknowledged.values()))

    def join(self, rank):
        self.joined.setdefault(rank, len(self.joined))

    def shutdown(self, rank):
        self.shut_down.add(rank)

    # ---- decisions -----------------------------------------------------------------------------------
    def plan(self):
        """Actions ready now, in the order every rank must execute them."""
        actions, allreduces = [], []
        for name in list(self.pending):
            entry = self.pending[name]
            action = self._decide(name, entry)
            if action is None:
                continue
            del self.pending[name]
            if action.kind != "error":
                self._remember(name, entry.metas)
            if action.kind == "allreduce":
                allreduces.append((name, action.metas[0]))
            else:
                actions.append(action)
        actions.extend(fuse_allreduces(allreduces, self.fusion_threshold))
        if self.joined and len(self.joined) + len(self.shut_down - set(self.joined)) >= self.size:
            last = max(self.joined, key=self.joined.get)
            actions.append(Action("join_done", rank=last))
            self.joined = {}
        if len(self.shut_down) >= self.size:
            actions.append(Action("shutdown"))
        return actions

    def take_new_cache_entries(self):
        """The cache changes since the last call: [(id, (name, Meta) or None)], for every rank to apply in order."""
        return self.cache.take_changes()

    def _remember(self, name, metas):
        put = self.cache.put
        for meta in dict.fromkeys(metas[r] for r in sorted(metas)):     # rank order: a deterministic choice
            put((name, meta))

    def _decide(self, name, entry):
        metas = entry.metas
        gone = self.shut_down - set(metas)
        if gone:
            return Action("error", (name,), message=f"tensor {name!r}: {_rank_list(gone)} already called shutdown() "
                          f"while {_rank_list(metas)} submitted it", error="RankFailureError")
        joined_missing = {r for r in self.joined if r not in metas}
        if len(metas) + len(joined_missing) < self.size:
            return None
        if len({_agreement_key(m) for m in metas.values()}) > 1:
            return Action("error", (name,), message=mismatch_message(name, metas), error="TensorMismatchError")
        meta = next(iter(metas.values()))
        if joined_missing and meta.kind != "allreduce":
            return Action("error", (name,), message=f"tensor {name!r}: {meta.kind} cannot run while "
                          f"{_rank_list(joined_missing)} {'has' if len(joined_missing) == 1 else 'have'} joined; "
                          "only allreduce can", error="RingtrainError")
        if meta.kind == "allgather":
            return Action("allgather", (name,), (meta,),
                          tuple(metas[r].shape[0] if metas[r].shape else 1 for r in range(self.size)))
        if meta.kind == "alltoall":
            return Action("alltoall", (name,), (meta,), tuple(tuple(metas[r].splits) for r in range(self.size)))
        return Action(meta.kind, (name,), (meta,))

    def check_stalls(self):
        """(warnings, fatal_message_or_None) for names some ranks submitted long ago and others never did.
        Once one name is past the timeout the stall is fatal, and the message names every name that has waited
        past the warning threshold too: ranks that diverged usually each wait on their own name, submitted
        moments apart, and the user needs to see both sides."""
        now = self.clock()
        warnings, stalled, fatal = [], [], False
        for name, entry in self.pending.items():
            age = now - entry.first_seen
            missing = set(range(self.size)) - set(entry.metas) - set(self.joined)
            fatal |= age > self.stall_timeout_s
            if age > self.stall_warning_s:
                stalled.append(f"tensor {name!r} was submitted by {_rank_list(entry.metas)} but not by "
                               f"{_rank_list(missing)} for {age:.0f}s")
                if not entry.warned:
                    entry.warned = True
                    warnings.append(f"tensor {name!r} has waited {age:.0f}s: submitted by "
                                    f"{_rank_list(entry.metas)}, still missing on {_rank_list(missing)} "
                                    "(ranks diverged? a rank skipped a step?)")
        if fatal:
            more = f"; and {len(stalled) - 5} more" if len(stalled) > 5 else ""
            return warnings, ("stall: " + "; ".join(stalled[:5]) + more
                              + f" (RINGTRAIN_STALL_TIMEOUT_S={self.stall_timeout_s:g})")
        return warnings, None
