"""The coordinator protocol's cache ids in flight, checked single-process: two CoordinatorAgreements (rank 0 and
rank 1) over a stand-in control channel that delivers each message only when the test says so, so the race the
protocol guards against -- rank 1 names an id that rank 0 has already evicted -- happens on purpose."""
import collections
from types import SimpleNamespace

from ringtrain.engine.control import TAG_TO_COORDINATOR
from ringtrain.engine.coordinator_agreement import CoordinatorAgreement
from ringtrain.engine.model import Meta
from ringtrain.ops import ReduceOp

CONFIG = SimpleNamespace(fusion_threshold=1 << 20, stall_warning_s=60.0, stall_timeout_s=120.0)


class _Wire:
    """Both ranks' mailboxes: (dest, tag) -> FIFO of (source, message)."""

    def __init__(self):
        self.boxes = collections.defaultdict(collections.deque)

    def end(self, rank):
        return _End(self, rank)


class _End:
    def __init__(self, wire, rank):
        self.wire, self.rank, self.size = wire, rank, 2

    def send(self, message, dest, tag):
        self.wire.boxes[(dest, tag)].append((self.rank, message))

    def receive(self, tag, source=None):
        box = self.wire.boxes[(self.rank, tag)]
        return box.popleft() if box else None

    def progress_sends(self):
        pass


class _Request:
    def __init__(self, name, nbytes=16):
        self.name = name
        self.meta = Meta(kind="allreduce", dtype="float32", shape=(nbytes // 4,), op=int(ReduceOp.SUM))


def _send(agreement):
    """What poll() sends first: this rank's submissions so far, as one message to rank 0."""
    agreement._flush_items()
    for message in agreement._outbox:
        agreement._to_coordinator(message)
    agreement._outbox = []


def _agreed(agreement):
    return [name for action in agreement.poll() for name in getattr(action, "names", ())]


def test_an_id_named_in_flight_resolves_to_the_entry_it_named_not_its_successor():
    """Cache of one entry. A is cached as id 0 on both ranks. Rank 1 then sends three submissions before it hears
    from rank 0 again: C, D, and A by its id 0. Rank 0 decides C (evicting A: id 0 retires) and D in between. Id 0
    must still mean A when rank 1's third message arrives -- it may be given to D only after rank 1 has applied the
    update that evicted A, which rank 1 has not."""
    wire = _Wire()
    r0 = CoordinatorAgreement(wire.end(0), CONFIG, watchdog=None, cache_capacity=1)
    r1 = CoordinatorAgreement(wire.end(1), CONFIG, watchdog=None, cache_capacity=1)
    a, c, d = _Request("A"), _Request("C"), _Request("D")

    r1.add(a)
    assert _agreed(r1) == []                      # sent to rank 0
    r0.add(a)
    assert _agreed(r0) == ["A"]
    assert _agreed(r1) == ["A"]                   # rank 1 applies the update that caches A
    assert r0.cache.get(("A", a.meta)) == r1.cache.get(("A", a.meta)) == 0

    for request in (c, d, a):                     # rank 1, hearing nothing back in between
        r1.add(request)
        _send(r1)
    assert [m[1] for _, m in wire.boxes[(0, TAG_TO_COORDINATOR)]][2] == [0]      # A by its id

    r0.add(c)
    r0.add(d)
    _send(r0)
    agreed = []
    while wire.boxes[(0, TAG_TO_COORDINATOR)]:    # rank 0 reads rank 1's messages one at a time
        source, message = wire.boxes[(0, TAG_TO_COORDINATOR)].popleft()
        r0._coordinate(source, message)
        agreed += [n for action in r0.plan_with_stall_check() for n in getattr(action, "names", ())]
        r0._apply_cache_changes(r0.coordinator.take_new_cache_entries())
    assert agreed == ["C", "D"]
    entry = r0.coordinator.pending.get("A")
    assert entry is not None and entry.metas == {1: a.meta}, r0.coordinator.pending
    assert "D" not in r0.coordinator.pending
