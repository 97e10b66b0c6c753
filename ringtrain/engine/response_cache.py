"""Small integer ids for collectives seen before, bounded: the least recently used entry is evicted first (as
Horovod's response cache). Pure bookkeeping, no MPI: rank 0's Coordinator owns one and decides every change;
the other ranks apply the same changes in the same order (`CacheView`), so an id means the same (name, Meta) on
every rank at every agreement cycle, and a job may use any number of names with memory that stays flat.

Ids are reused lowest first, so the ready bitmaps of an agreement cycle stay as short as the cache is full.

Two ways an evicted id becomes free again:
- synchronous (the cycle agreement): every rank hands over everything it holds in the slow cycle in which rank 0
  decides the changes, and applies them before it names any id again -- an evicted id may be reused at once;
- asynchronous (the coordinator protocol): a rank may name an id in a message already on its way while rank 0
  evicts it. The id then *retires*: it still resolves to its old entry until every rank has acknowledged the
  update that evicted it (each message carries the number of updates its sender applied), and only then is free.
"""
import collections
import heapq


class ResponseCache:
    """Rank 0's side: assigns, touches and evicts; take_changes() is what every rank must apply next."""

    def __init__(self, capacity, synchronous=True):
        self.capacity = max(0, int(capacity))
        self.synchronous = synchronous
        self.ids = {}                               # (name, Meta) -> id
        self.keys = {}                              # id -> (name, Meta), live and retiring
        self._recent = collections.OrderedDict()    # live ids, least recently used first
        self._free = list(range(self.capacity))     # a heap: the lowest free id is handed out first
        self._retiring = collections.deque()        # (update number, id) evicted, not yet acknowledged everywhere
        self.updates = 0                            # updates taken so far (each a list of changes)
        self._changes = []                          # (id, (name, Meta) or None) since the last take_changes()

    def __len__(self):
        return len(self._recent)

    def lookup(self, cid):
        """The entry an id names (a retiring id still names its old entry)."""
        return self.keys[cid]

    def get(self, key):
        return self.ids.get(key)

    def touch(self, cid):
        """The entry was used: it becomes the most recently used."""
        recent = self._recent
        if cid in recent:
            recent.move_to_end(cid)

    def put(self, key):
        """Cache key (touching it if present); returns its id, or None when no id is free (capacity 0, or every
        evicted id still retiring): the entry then simply travels in full."""
        cid = self.ids.get(key)
        if cid is not None:
            self._recent.move_to_end(cid)
            return cid
        if not self._free and self._recent:
            self._evict(next(iter(self._recent)))
        if not self._free:
            return None
        cid = heapq.heappop(self._free)
        self.ids[key] = cid
        self.keys[cid] = key
        self._recent[cid] = None
        self._changes.append((cid, key))
        return cid

    def _evict(self, cid):
        key = self.keys[cid]
        del self.ids[key]
        del self._recent[cid]
        self._changes.append((cid, None))
        if self.synchronous:
            del self.keys[cid]
            heapq.heappush(self._free, cid)
        else:
            self._retiring.append((self.updates + 1, cid))     # announced in the next update

    def take_changes(self):
        """The changes since the last call, in order, for every rank to apply (one update; [] when none)."""
        changes, self._changes = self._changes, []
        if changes:
            self.updates += 1
        return changes

    def release(self, acknowledged):
        """Every rank has applied updates 1..acknowledged: ids they evicted are free again."""
        retiring = self._retiring
        while retiring and retiring[0][0] <= acknowledged:
            _, cid = retiring.popleft()
            del self.keys[cid]
            heapq.heappush(self._free, cid)


class CacheView:
    """Every rank's copy of the cache: (name, Meta) -> id, kept equal to rank 0's by applying its changes."""

    def __init__(self):
        self.ids = {}          # (name, Meta) -> id
        self.keys = {}         # id -> (name, Meta)
        self.updates = 0       # updates applied (acknowledged to rank 0 in the coordinator protocol)
        self.highest = -1      # the highest id ever assigned: ready bitmaps span ids 0..highest
        self.assigned = 0      # entries added (first sightings), and
        self.evicted = 0       # entries dropped to make room: for the metrics

    def get(self, key):
        return self.ids.get(key)

    def apply(self, changes):
        """Apply one update from rank 0; returns the ids whose meaning changed (callers drop what they derived)."""
        if not changes:
            return ()
        ids, keys = self.ids, self.keys
        for cid, key in changes:
            old = keys.pop(cid, None)
            if old is not None and ids.get(old) == cid:
                del ids[old]
                self.evicted += 1
            if key is not None:
                self.assigned += 1
                ids[key] = cid
                keys[cid] = key
                if cid > self.highest:
                    self.highest = cid
        self.updates += 1
        return [cid for cid, _ in changes]

    def __len__(self):
        return len(self.ids)
