"""Agreement across ranks on which collectives are ready, decided by rank 0 (pure logic: no MPI here).

Every rank tells the coordinator (rank 0) the requests it has queued: the full metadata the first time a name is seen,
then only a small integer cache id while the metadata stays the same (the steady-state fast path: a training step sends a
list of ints, not shapes and dtypes). The coordinator answers with an ordered list of actions that every rank executes
in the same order, which is what makes out-of-order submission safe and deadlock-free.
"""
import collections
import dataclasses
import time

from .model import Collective, Failed, JoinDone, Shutdown
from .response_cache import ResponseCache

CACHE_CAPACITY = 1024         # Horovod's default (RINGTRAIN_CACHE_CAPACITY)


def _agreement_key(meta):
    """The part of the metadata that must be identical on every rank (allgather/alltoall may differ in dim 0)."""
    shape = meta.shape[1:] if meta.kind in ("allgather", "alltoall") else meta.shape
    return (meta.kind, meta.dtype, shape, meta.op, meta.root, meta.device, meta.scales, meta.parts)


# kinds whose metadata is the same on every rank: a cache id then names the same collective everywhere, which is
# what lets ranks agree on them without the coordinator (allgather/alltoall differ per rank in dim 0 / splits)
SAME_EVERYWHERE = frozenset(("allreduce", "broadcast", "reducescatter", "barrier"))


def fusion_key(meta):
    """Allreduces fuse into one bucket only when they reduce the same way."""
    return (meta.dtype, meta.op, meta.device, meta.scales)


def fuse_allreduces(named_metas, threshold, size):
    """[(name, meta)] in execution order -> allreduce Collectives on `size` ranks, each one bucket of <= threshold
    bytes (a single larger tensor gets a bucket of its own). Pure and deterministic: every rank that runs it on the
    same list gets the same buckets, which is what the coordinator-free fast path relies on."""
    open_buckets = {}                        # fusion key -> [names, metas, bytes], in order of first use
    actions = []
    for name, meta in named_metas:
        key = fusion_key(meta)
        bucket = open_buckets.get(key)
        if bucket is not None and bucket[2] + meta.nbytes > threshold:
            actions.append(Collective.of("allreduce", bucket[0], bucket[1], size))
            del open_buckets[key]
            bucket = None
        if bucket is None:
            bucket = open_buckets[key] = [[], [], 0]
        bucket[0].append(name)
        bucket[1].append(meta)
        bucket[2] += meta.nbytes
    actions.extend(Collective.of("allreduce", names, metas, size) for names, metas, _ in open_buckets.values())
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
            if isinstance(action, Failed):
                actions.append(action)
                continue
            self._remember(name, entry.metas)
            if action.kind == "allreduce":
                allreduces.append((name, action.metas[0]))
            else:
                actions.append(action)
        actions.extend(fuse_allreduces(allreduces, self.fusion_threshold, self.size))
        if self.joined and len(self.joined) + len(self.shut_down - set(self.joined)) >= self.size:
            last = max(self.joined, key=self.joined.get)
            actions.append(JoinDone(last))
            self.joined = {}
        if len(self.shut_down) >= self.size:
            actions.append(Shutdown())
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
            return Failed((name,), "RankFailureError", f"tensor {name!r}: {_rank_list(gone)} already called "
                          f"shutdown() while {_rank_list(metas)} submitted it")
        joined_missing = {r for r in self.joined if r not in metas}
        if len(metas) + len(joined_missing) < self.size:
            return None
        if len({_agreement_key(m) for m in metas.values()}) > 1:
            return Failed((name,), "TensorMismatchError", mismatch_message(name, metas))
        meta = next(iter(metas.values()))
        if joined_missing and meta.kind != "allreduce":
            return Failed((name,), "RingtrainError", f"tensor {name!r}: {meta.kind} cannot run while "
                          f"{_rank_list(joined_missing)} {'has' if len(joined_missing) == 1 else 'have'} joined; "
                          "only allreduce can")
        if meta.kind == "allgather":
            return Collective.of("allgather", (name,), (meta,), self.size,
                                 first_dims=tuple(metas[r].shape[0] if metas[r].shape else 1 for r in range(self.size)))
        if meta.kind == "alltoall":
            return Collective.of("alltoall", (name,), (meta,), self.size,
                                 splits=tuple(tuple(metas[r].splits) for r in range(self.size)))
        return Collective.of(meta.kind, (name,), (meta,), self.size)

    def check_stalls(self):
        """(warnings, Failed or None) for names some ranks submitted long ago and others never did.
        Once one name is past the timeout the stall is fatal, and its message names every name that has waited
        past the warning threshold (or the timeout, when that is shorter): for each, the ranks that submitted it and
        the ranks that did not -- ranks that diverged usually each wait on their own name, submitted moments apart,
        and the user needs to see both sides.
        What the stall ends is the oldest stalled name and every stalled name held by exactly its ranks: those leave
        the book here, each rank drops them (the Failed action; its holders raise StallError) and the collectives
        after them agree as usual, so a stall leaves the job usable. The names the other ranks wait on stay: when
        those ranks had skipped the failed collective (a rank skipped a step), their next collective is the one the
        failed ranks call next, and it completes; when the ranks had truly diverged (each named the same call
        differently), the other side's name ends the same way one stall timeout later (the names left waiting start
        a new period now). Ending both sides at once would shift every later call of the ranks that skipped by
        one."""
        now = self.clock()
        warnings, stalled, fatal = [], [], False
        threshold = min(self.stall_warning_s, self.stall_timeout_s)
        for name, entry in self.pending.items():
            age = now - entry.first_seen
            missing = set(range(self.size)) - set(entry.metas) - set(self.joined)
            fatal |= age > self.stall_timeout_s
            if age > threshold:
                stalled.append((name, f"tensor {name!r} was submitted by {_rank_list(entry.metas)} but not by "
                                      f"{_rank_list(missing)} for {age:.0f}s"))
            if age > self.stall_warning_s and not entry.warned:
                entry.warned = True
                warnings.append(f"tensor {name!r} has waited {age:.0f}s: submitted by "
                                f"{_rank_list(entry.metas)}, still missing on {_rank_list(missing)} "
                                "(ranks diverged? a rank skipped a step?)")
        if not fatal:
            return warnings, None
        more = f"; and {len(stalled) - 5} more" if len(stalled) > 5 else ""
        message = ("stall: " + "; ".join(text for _, text in stalled[:5]) + more
                   + f" (RINGTRAIN_STALL_TIMEOUT_S={self.stall_timeout_s:g})")
        oldest = min((e for e in self.pending.values() if now - e.first_seen > self.stall_timeout_s),
                     key=lambda e: e.first_seen)
        holders = set(oldest.metas)
        names = tuple(name for name, _ in stalled if set(self.pending[name].metas) == holders)
        for name in names:
            del self.pending[name]
        for entry in self.pending.values():      # the rest wait a full period again, from the failure on
            entry.first_seen, entry.warned = now, False
        return warnings, Failed(names, "StallError", message)
