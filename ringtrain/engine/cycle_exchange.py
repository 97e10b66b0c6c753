"""How one agreement cycle's slots travel between the ranks (the cycle's logic is CycleAgreement, cycle_agreement.py).

In cycle c every rank publishes a slot -- flag word, ready-bitmap of cache ids, and optionally one small allreduce's
id and data ("eager") -- then waits until it holds cycle c's slot of every rank. Every rank then reads the same
snapshot. Two ways to move the slots, one interface:

  entered_by_peer(cycle) -> bool      has some peer already published cycle + 1? (an idle rank follows it in)
  publish(c, flags, bitmap, words, eager)   eager: (cache id, array) or None
  gather(c)                           wait for every rank's cycle-c slot; StallError naming the missing ranks
  flags(p), bitmap(p, words), eager_data(p, nbytes, dtype)   of cycle c's slot of rank p
  eager_everywhere(cid, nbytes)       did every rank publish that eager allreduce in cycle c?
  waited                              (peer, start) when the last gather had to wait: the peer it waited for last
                                      and when it began waiting (perf_counter); None when everyone was there
  published(c, peers=None)            WindowExchange: has every peer (or every one of `peers`) published cycle c?
                                      A wait's poll: notes the one it finds missing, the peer `waited` will name
  wait_over(start)                    a wait for a cycle that began at `start` is over: sets `waited` when it was
                                      longer than the exchange's own handshake
  leader                              (cycle, peer) when this rank followed a peer into that cycle
  add_wait(peer, seconds), wait_rows()   this rank's running total of how long it waited for each rank, kept in its
                                      slots (both parities), and every rank's totals as they last arrived here
  close()

WindowExchange (one node): the slots live in an MPI shared-memory window, two per rank (by the parity of c), and
"published" is a cycle number each rank bumps. A peer can write slot (c % 2) again only in cycle c + 2, which it
can enter only after this rank published c + 1, i.e. after this rank finished reading cycle c.

MessageExchange (ranks on several nodes): each rank sends its slot to every peer, one small message each
(point-to-point, so the ranks that never sent are known by name, and an idle rank can see that a cycle started by
testing its posted receive). Every rank always has one receive posted per peer, for the next cycle. A peer runs at
most one cycle ahead (it cannot finish cycle c + 1 without our slot of c + 1), and MPI keeps one sender's messages
in order, so the message that completes the receive for cycle c + 1 is that peer's cycle c + 1. The cost is
(N - 1) messages per rank per cycle: make_agreement uses it up to MESSAGE_CYCLE_MAX_RANKS ranks.
"""
import time

import numpy as np
from mpi4py import MPI

from ..errors import StallError
from . import native_cycle

_LINE = 64
TAG_CYCLE = 13
WAIT_FLOOR_S = 1e-4         # a shorter wait in a gather is the exchange's own handshake, not a late rank
MESSAGE_CYCLE_MAX_RANKS = 64


class _SlotViews:
    """One slot's bytes: header words [cycle, flags, eager id (-1: none), eager nbytes], the wait row (microseconds
    this rank has waited for each rank in cycles, then how many times), the bitmap words, then the eager data.
    Header and bitmap are memoryviews: a Python int in or out costs a third of a numpy scalar's, and every cycle
    reads and writes a handful of them per rank. The wait row changes only when this rank waited."""

    def __init__(self, raw, words, size):
        ints = raw[:self.header_bytes(words, size)].view(np.int64)
        self.header = memoryview(ints[:4])
        self.waits = memoryview(ints[4:4 + 2 * size])
        self.bitmap_array = ints[4 + 2 * size:4 + 2 * size + words].view(np.uint64)
        self.bitmap = memoryview(self.bitmap_array)
        self.data = raw[self.header_bytes(words, size):]
        self._views = {}

    @staticmethod
    def header_bytes(words, size):
        return -(-(4 + 2 * size + words) * 8 // _LINE) * _LINE

    def eager_data(self, nbytes, dtype):
        key = (nbytes, dtype)
        view = self._views.get(key)
        if view is None:
            if len(self._views) > 64:
                self._views.clear()
            view = self._views[key] = self.data[:nbytes].view(dtype)
        return view


def _write_bitmap(slot, bitmap, words):
    if words == 1:
        slot.bitmap[0] = bitmap
    else:
        slot.bitmap_array[:words] = np.frombuffer(bitmap.to_bytes(words * 8, "little"), dtype=np.uint64)


def _read_bitmap(words_view, words):
    if words == 1:
        return words_view[0]
    return int.from_bytes(words_view[:words].tobytes(), "little")


class _Exchange:
    """What both exchanges share: slot views per (rank, parity) and reading them."""

    native = None                               # the compiled express cycle (WindowExchange only)

    def __init__(self, rank, size, config, watchdog, max_words, eager_bytes, copy_in):
        self.rank, self.size, self.config, self.watchdog = rank, size, config, watchdog
        self._copy_in = copy_in                 # copy_in(slot view, array): the executor's copy into our slot
        self.peers = [p for p in range(size) if p != rank]
        if eager_bytes % _LINE:              # the next slot's int64 header must stay aligned
            raise ValueError(f"eager_bytes must be a multiple of {_LINE}, got {eager_bytes}")
        self.eager_bytes = eager_bytes          # the largest eager data a slot holds
        self._header_bytes = _SlotViews.header_bytes(max_words, size)
        self.slot_bytes = self._header_bytes + eager_bytes
        self._max_words = max_words
        self._parity = 0
        self.waited = None                      # see gather(): (peer, start) when it had to wait
        self._last = None                       # the peer found missing at the latest poll of a wait
        self.leader = None                      # (cycle, peer): the peer seen in that cycle before we entered it

    def _views(self, buffers):
        return [tuple(_SlotViews(b, self._max_words, self.size) for b in pair) for pair in buffers]

    def wait_over(self, start):
        """A wait for a cycle (a gather's, or the agreement's native rounds) that began at `start` (perf_counter) is
        over; it was for the peer its polls last found missing (among the last to come): worth a straggler score
        (`waited`) when it is longer than the exchange itself takes (WAIT_FLOOR_S)."""
        if time.perf_counter() - start >= WAIT_FLOOR_S:
            self.waited = (self._last, start)

    def add_wait(self, peer, seconds):
        """Add one wait for `peer` to this rank's row, in both of its slots (peers read whichever they hold)."""
        us = int(seconds * 1e6)
        size = self.size
        for slot in self._slots[self.rank]:
            waits = slot.waits
            waits[peer] += us
            waits[size + peer] += 1

    def wait_rows(self):
        """[rank][peer] -> (microseconds that rank waited for peer, how many waits), every rank's row as this rank
        last holds it (a cycle or so old at most; a row only grows)."""
        size = self.size
        rows = []
        for pair in self._slots:
            waits = max((slot.waits for slot in pair), key=lambda w: sum(w[size:]))
            rows.append([(waits[p], waits[size + p]) for p in range(size)])
        return rows

    def _slot(self, p):
        return self._slots[p][self._parity]

    def flags(self, p):
        return self._slot(p).header[1]

    def bitmap(self, p, words):
        return _read_bitmap(self._slot(p).bitmap, words)

    def eager_everywhere(self, cid, nbytes):
        """Did every rank (this one included) publish eager data `cid` of `nbytes` bytes in this cycle?"""
        for pair in self._slots:
            header = pair[self._parity].header
            if header[2] != cid or header[3] != nbytes:
                return False
        return True

    def eager_data(self, p, nbytes, dtype):
        return self._slot(p).eager_data(nbytes, dtype)

    def _fill(self, c, flags, bitmap, words, eager):
        """Write our slot for cycle c; returns its length in bytes (header, plus eager data when there is some)."""
        self._parity = c % 2
        mine = self._slot(self.rank)
        header = mine.header
        header[0] = c
        header[1] = flags
        _write_bitmap(mine, bitmap, words)
        if eager is None:
            header[2] = -1
            return self._header_bytes
        cid, array = eager
        header[2] = cid
        header[3] = array.nbytes
        self._copy_in(mine.eager_data(array.nbytes, array.dtype), array)
        return self._header_bytes + array.nbytes

    def _stall(self, c, missing):
        timeout = self.config.stall_timeout_s
        raise StallError(f"rank {self.rank}: ranks {missing} did not reach agreement cycle {c} within "
                         f"{timeout:g} s (their engines stopped answering)")


class WindowExchange(_Exchange):
    """Slots in an MPI shared-memory window on the node communicator (every rank on one node)."""

    def __init__(self, node, config, watchdog, max_words, eager_bytes, copy_in, native=False):
        super().__init__(node.Get_rank(), node.Get_size(), config, watchdog, max_words, eager_bytes, copy_in)
        # per rank: one cache line holding the cycle number it last published, then its two slots
        per_rank = _LINE + 2 * self.slot_bytes
        self._win = MPI.Win.Allocate_shared(per_rank, 1, comm=node)
        self._win.Lock_all(MPI.MODE_NOCHECK)
        buffers, published = [], []
        for p in range(self.size):
            mem, _ = self._win.Shared_query(p)
            raw = np.frombuffer(mem, dtype=np.uint8, count=per_rank)
            published.append(memoryview(raw[:8].view(np.int64)))
            buffers.append((raw[_LINE:_LINE + self.slot_bytes], raw[_LINE + self.slot_bytes:]))
            if p == self.rank:
                raw[:] = 0                     # MPI does not zero the window; each rank clears its own part
        self._slots = self._views(buffers)
        self._published = published
        # the express cycle in compiled code (native_cycle.py), on the same slots and published words
        self.native = native_cycle.NativeCycle.open(
            self.rank, self.size, self._header_bytes, (4 + 2 * self.size) * 8,
            [p.obj.__array_interface__["data"][0] for p in published],
            [tuple(b.__array_interface__["data"][0] for b in pair) for pair in buffers]) if native else None
        self._win.Sync()
        node.Barrier()
        self._win.Sync()

    def entered_by_peer(self, cycle):
        for p in self.peers:
            if self._published[p][0] > cycle:
                self.leader = (cycle + 1, p)
                return True
        return False

    def publish(self, c, flags, bitmap, words, eager):
        self._fill(c, flags, bitmap, words, eager)
        self._win.Sync()
        self._published[self.rank][0] = c

    def gather(self, c, start=None):
        """start: when this rank began waiting, if before this call (perf_counter)."""
        if not self.published(c):       # someone is not there yet: the Watchdog's bounded wait
            start = start or time.perf_counter()
            missing = self.watchdog.wait_for_all(self.peers, lambda q: self.published(c, (q,)),
                                                 f"agreement cycle {c}", self.config.stall_timeout_s)
            if missing:
                self._stall(c, missing)
            self.wait_over(start)
        self._win.Sync()

    def published(self, c, peers=None):
        """Has every one of `peers` (default: every peer) published cycle c? One poll of a wait for c (the gather's,
        through Watchdog.wait_for_all one peer at a time, or the agreement's native rounds): each peer found
        missing is noted, and the last of them is the one the wait is for (wait_over)."""
        published = self._published
        everyone = True
        for q in self.peers if peers is None else peers:
            if published[q][0] < c:
                self._last = q           # still missing at this poll: among the last to come
                everyone = False
        return everyone

    def close(self):
        """Collective over the node: frees the window."""
        if self._win is not None:
            if self.native is not None:
                self.native.close()
                self.native = None
            self._slots = self._published = None
            self._win.Unlock_all()
            self._win.Free()
            self._win = None


class MessageExchange(_Exchange):
    """Slots as point-to-point messages on the control communicator: each rank sends its slot to every peer."""

    def __init__(self, ctrl, config, watchdog, max_words, eager_bytes, copy_in):
        super().__init__(ctrl.Get_rank(), ctrl.Get_size(), config, watchdog, max_words, eager_bytes, copy_in)
        self._ctrl = ctrl
        buffers = [(np.zeros(self.slot_bytes, np.uint8), np.zeros(self.slot_bytes, np.uint8)) for _ in range(self.size)]
        self._buffers = buffers
        self._slots = self._views(buffers)
        self._sends = ([], [])                 # outstanding sends of our slot, by parity
        self._receives = {}                    # peer -> receive posted for the next cycle (None once it arrived)
        self._next = 1                         # the cycle those receives are for
        self._post_receives()

    def _post_receives(self):
        parity = self._next % 2
        self._receives = {p: self._ctrl.Irecv([self._buffers[p][parity], MPI.BYTE], source=p, tag=TAG_CYCLE)
                          for p in self.peers}

    def _arrived(self, p):
        request = self._receives[p]
        if request is None:
            return True
        if request.Test():
            self._receives[p] = None
            return True
        return False

    def _arrived_noting(self, q):
        if self._arrived(q):
            return True
        self._last = q
        return False

    def entered_by_peer(self, cycle):
        if cycle + 1 != self._next:
            return False
        for p in self.peers:
            if self._arrived(p):
                self.leader = (cycle + 1, p)
                return True
        return False

    def publish(self, c, flags, bitmap, words, eager):
        # an idle rank follows a peer into a cycle on the engine thread: after a death it must not send to the
        # dead rank (see Watchdog.check_sendable)
        self.watchdog.check_sendable(f"agreement cycle {c}")
        parity = c % 2
        # our cycle c - 2 message used this buffer; every peer has it (they finished c - 1 with our c - 1 slot)
        MPI.Request.Waitall(self._sends[parity])
        nbytes = self._fill(c, flags, bitmap, words, eager)
        mine = self._buffers[self.rank][parity][:nbytes]
        self._sends[parity][:] = [self._ctrl.Isend([mine, MPI.BYTE], dest=p, tag=TAG_CYCLE) for p in self.peers]

    def gather(self, c):
        assert c == self._next, f"rank {self.rank}: cycle {c} while receives are posted for cycle {self._next}"
        for p in self.peers:
            if not self._arrived(p):      # someone is not there yet: the Watchdog's bounded wait
                start = time.perf_counter()
                self._last = p
                missing = self.watchdog.wait_for_all(self.peers, self._arrived_noting, f"agreement cycle {c}",
                                                     self.config.stall_timeout_s)
                if missing:
                    self._stall(c, missing)
                self.wait_over(start)
                break
        for p in self.peers:
            got = self._slots[p][c % 2].header[0]
            assert got == c, f"rank {self.rank}: rank {p} sent its cycle {got} slot in cycle {c}"
        self._next = c + 1
        self._post_receives()

    def close(self):
        for request in self._receives.values():
            if request is not None:
                request.Cancel()
                request.Wait()
        self._receives = {}
        for sends in self._sends:
            MPI.Request.Waitall(sends)
