"""The cycle agreement of 2..N ranks (CycleAgreement): the steady state needs no rank 0.

Ranks agree in *cycles*: in cycle c each rank publishes a slot -- a flag word and a bitmap of the cache ids it has
ready -- and waits until it holds every rank's cycle-c slot (cycle_exchange.py moves the slots: a shared window on one
node, one message per peer across nodes). Every rank thereby reads the same snapshot, so every rank computes the same
decision with no further message:
  - no flags anywhere: run the ids set on EVERY rank, in id order, fused into buckets by a pure function;
  - any flag (a first sighting, join, shutdown, a request pending too long, or rank 0's coordinator still holding
    something): a *slow cycle* -- every rank hands everything it holds to rank 0's Coordinator over MPI and
    executes the actions it sends back, exactly as the coordinator protocol (coordinator_agreement.py) does;
    mismatch, stall and join handling (and their messages) are the Coordinator's.

Eager small allreduces: a slot also carries the data of this rank's lowest pending small host allreduce (one
array, no prescale; up to window_eager_bytes(N) on one node -- 1 MB for 2 ranks, 512 KB for 4 -- and 64 KB across
nodes (agreement.py sizes the slots); an array in the transport's shared window only up to SHARED_EAGER_BYTES) and
its id. When the lowest ready id is such an allreduce and EVERY rank published that id, its Collective says so
(source SLOTS, with the slots' views) and the executor reduces the published copies in rank order (bitwise the same
result everywhere) straight into its output before this rank enters another cycle: the agreement exchange is the
only synchronisation a small allreduce pays. The agreement itself never touches tensor data: it only decides (typed
actions, model.py).
Express: a synchronous cached host allreduce with nothing else pending on this rank skips the request machinery
altogether (express()): one cycle on the caller's thread, then the executor (from the slots or the transport).
A rank enters the next cycle when it has something new, when a peer has entered it (the engine thread looks for
that even while idle), or, on rank 0, when the Coordinator's stall check is due. Nothing new anywhere means nobody
cycles: no busy loop.
"""
import time

from .control import TAG_FROM_COORDINATOR, TAG_TO_COORDINATOR
from .coordinator_agreement import CoordinatorAgreement
from .model import Collective, Source, express_eligible
from ..errors import StallError
from .watchdog import YIELD_S
from .negotiation import SAME_EVERYWHERE, fuse_allreduces
from ..ops import DTYPES, result_scale
from .fast_state import FastState
from . import native_cycle
from ..transports.segments import Segments

# flag bits of a cycle slot
_WANTS_COORDINATOR = 1      # this rank has first sightings, join/shutdown, or a request pending too long
_COORDINATOR_BUSY = 2       # rank 0: the Coordinator still holds undecided requests or joined ranks
SHARED_EAGER_BYTES = 512 << 10  # an array in the transport's shared window is eager only up to this
_SPIN_NS = int(native_cycle.SPIN_S * 1e9)    # the native call's bounded spin
_YIELD_NS = int(YIELD_S * 1e9)               # a caller's further native rounds (_native_wait)
HANDOVER_S = 0.5            # a cached request not ready everywhere for this long goes to the Coordinator, which
                            # names the missing ranks in its stall warnings and errors


class CycleAgreement(CoordinatorAgreement):
    """Cached collectives are agreed in cycles through an exchange (cycle_exchange.py); the rest through the
    Coordinator."""

    synchronous = True               # ids are named only in cycles; every change is applied in the slow cycle

    def __init__(self, control, exchange, config, watchdog, cache_capacity, shared=None):
        super().__init__(control, config, watchdog, cache_capacity)
        self._exchange = exchange
        self._shared = shared or (lambda array: False)   # does the host transport reduce this array where it lies?
        self._ready = 0                  # bitmap (Python int) of this rank's fast-path ids
        self._ready_since = {}           # id -> time it was submitted (handover to the coordinator when old)
        self._handed = []                # items held for the next slow cycle
        self._dirty = False              # something new since the last cycle
        self._cycle = 0
        self._words = 1                  # bitmap words in use: ids are reused lowest first and change only in
                                         # slow cycles, so this is the same on every rank in every cycle
        # rank 0 decides evictions: it keeps the cache's LRU order, touching every id the fast path runs
        self._touch = self.coordinator.cache.touch if self.coordinator is not None else None
        self._eager = {}                 # id -> Request that may travel eagerly (small host allreduce)
        self._single_actions = {}        # id -> its Collective on the buffers (the same few recur every step)
        self._eager_actions = {}         # (id, slot parity) -> its Collective on the slots
        self._native = exchange.native   # the express cycle in compiled code (native_cycle.py), or None
        self._native_how = {}            # id -> how the native cycle reduces it (native_cycle.reduce_how)
        self._peers = exchange.peers
        self._eager_bytes = exchange.eager_bytes
        self.fast = FastState.open(self, self._native)    # a planned call whole in compiled code, or None
        self.stragglers = None           # the engine's Stragglers (stragglers.py): who we wait for, and how long

    # ---- input -----------------------------------------------------------------------------------------------
    def add(self, req):
        key = (req.name, req.meta)
        cid = self.cache.get(key)
        if cid is not None and req.meta.kind in SAME_EVERYWHERE:
            if _eager_candidate(req) and self._eager_fits(req.arrays[0]):
                self._eager[cid] = req
            self._ready |= 1 << cid
            self._ready_since[cid] = time.monotonic()
        else:
            self._handed.append(key if cid is None else cid)
        self._dirty = True

    def add_control(self, kind):
        self._handed.append((kind,))
        self._dirty = True

    def owes(self):
        return bool(self._ready or self._handed) or super().owes()

    # ---- cycles ----------------------------------------------------------------------------------------------
    def poll(self, lazy=False):
        """lazy: leave a peer's cycle to this rank's caller unless this rank owes something (Engine._pass)."""
        if not self._should_enter(lazy):
            return []
        return self._run_cycle()

    def _should_enter(self, lazy=False):
        if self._dirty or self._exchange.entered_by_peer(self._cycle) and not (
                lazy and not self._ready and not self._handed and not CoordinatorAgreement.owes(self)):
            return True
        now = time.monotonic()
        if self._ready and min(self._ready_since.values()) < now - HANDOVER_S:
            return True
        return self.rank == 0 and super().owes() and now > self._next_stall_check

    def _run_cycle(self):
        ready = self._ready
        wants = bool(self._handed) or (ready and min(self._ready_since.values()) < time.monotonic() - HANDOVER_S)
        eager = None
        if self._eager:
            cid = min(self._eager)
            eager = (cid, self._eager[cid].arrays[0])
        c, flags, ready = self._exchange_slots(_WANTS_COORDINATOR if wants else 0, ready, eager)
        self._dirty = False
        if flags:
            return self._slow_cycle(c)
        return self._fast_actions(ready)

    def _exchange_slots(self, flags, ready, eager):
        """Publish our slot for the next cycle and gather everyone's: (cycle, every rank's flags OR-ed together,
        the ids ready on every rank). Rank 0 adds its own flag while its Coordinator still holds something."""
        c = self._cycle + 1
        exchange = self._exchange
        if self.rank == 0 and CoordinatorAgreement.owes(self):
            flags |= _COORDINATOR_BUSY
        exchange.publish(c, flags, ready, self._words, eager)
        exchange.gather(c)
        return self._read_snapshot(c, flags, ready)

    def _read_snapshot(self, c, flags, ready):
        """After cycle c's gather: (c, every rank's flags OR-ed together, the ids ready on every rank)."""
        exchange = self._exchange
        words = self._words
        offered = ready
        self._cycle = c
        for p in self._peers:
            flags |= exchange.flags(p)
            if ready:
                ready &= exchange.bitmap(p, words)
        waited = exchange.waited
        if waited is not None:
            exchange.waited = None
        if offered and self.stragglers is not None and (waited is not None or flags or ready != offered
                                                        or self.stragglers.waiting):
            self.stragglers.after_cycle(c, offered, ready, flags, waited, words)
        return c, flags, ready

    def _eager_fits(self, array):
        """Eager up to the slot size -- but an array the transport reduces where it lies (in the shm window) only
        up to SHARED_EAGER_BYTES: past that its two barriers cost less than the copy into the slot. Never the
        Segments of a grouped express allreduce (a grouped request is never eager either)."""
        if isinstance(array, Segments):
            return False
        nbytes = array.nbytes
        return 0 < nbytes <= self._eager_bytes and (nbytes <= SHARED_EAGER_BYTES or not self._shared(array))

    def _eager_action(self, name, meta, cid, nbytes):
        """The allreduce of `cid` from the cycle's slots when every rank published it there (the executor reduces
        the copies in rank order: bitwise the same result on every rank), else None. The slots stay valid until
        this rank enters its next cycle, which it does only after running this cycle's actions."""
        exchange = self._exchange
        if not exchange.eager_everywhere(cid, nbytes):
            return None
        # made once per (id, slot parity): the slot views of a parity are the same arrays every other cycle, and a
        # small allreduce must not pay for building the record each time (~5 us of a ~16 us 4 KB express call)
        key = (cid, self._cycle % 2)
        action = self._eager_actions.get(key)
        if action is None:
            dtype = DTYPES[meta.dtype]
            slots = tuple(exchange.eager_data(p, nbytes, dtype) for p in range(self.size))
            action = self._eager_actions[key] = Collective.of("allreduce", (name,), (meta,), self.size,
                                                              source=Source.SLOTS, slots=slots)
        return action

    # ---- express -------------------------------------------------------------------------------------------
    def express(self, name, meta, array, out, make_request, plan=None, resumed=None):
        """One cycle for one cached host allreduce when nothing else is pending on this rank: what add() and poll()
        would do, minus their bookkeeping. Publish its id as our only ready bit (with its data when it fits a slot),
        gather, and if no rank raised a flag and every rank has that id ready, the Collective of this array alone,
        for the executor to run now: from the slots when every rank published it there, else (too large for a
        slot, or some rank published no data or other data) on the buffers. A rank that holds it as a request
        computes the same Collective from that snapshot (_fast_actions sees the same headers).
        Any other snapshot: make_request(name, meta, array, out) registers the request with the engine, the
        agreement takes the state add() would have left, and the cycle's actions are returned (a list) for the engine
        to run -- the same actions every other rank computes from the same snapshot. None (nothing done) when the
        fast path does not apply: something pending, or a name not cached yet.
        plan: the call's ExpressPlan (express_memo.py): its cache id and native reduce, re-read whenever the cache
        changed since they were read."""
        if resumed is None and (self._ready or self._handed or self._dirty or not array.nbytes):
            return None
        if plan is None:
            cid = self.cache.get((name, meta))
            how = False
        else:
            if plan.generation != self.cache.updates:
                self._read_plan(plan)
            cid, how = plan.cid, plan.how
            # the usual call: cached, natively reduced, small enough for a slot wherever it lies (plan.native),
            # with C-contiguous buffers (a plan's array is; `out` may be the caller's): the compiled cycle straight
            if plan.native and self._native is not None and (out is array or out.flags.c_contiguous):
                bit = 1 << cid
                got = self._native_cycle(cid, bit, array, out, meta, how, resumed)
                if got is True:
                    return True
                c, flags, ready = got
                return self._express_outcome(name, meta, cid, bit, array, out, make_request, (cid, array), c, flags,
                                             ready)
        if cid is None:
            return None
        bit = 1 << cid
        if plan is not None:        # a plan's array is one ndarray (a group's is packed): no Segments here
            nbytes = plan.nbytes
            fits = nbytes <= self._eager_bytes and (nbytes <= SHARED_EAGER_BYTES or not self._shared(array))
        else:
            fits = self._eager_fits(array)
        eager = (cid, array) if fits else None
        if eager is not None and self._native is not None and array.flags.c_contiguous and out.flags.c_contiguous:
            c = self._native_cycle(cid, bit, array, out, meta, how)
            if c is True:
                return True
            c, flags, ready = c
        else:
            c, flags, ready = self._exchange_slots(0, bit, eager)
        return self._express_outcome(name, meta, cid, bit, array, out, make_request, eager, c, flags, ready)

    def _express_outcome(self, name, meta, cid, bit, array, out, make_request, eager, c, flags, ready):
        """express() after its cycle c was gathered and read (flags, ready): its Collective, or its request's."""
        if not flags and ready:
            if self._touch is not None:
                self._touch(cid)
            action = self._eager_action(name, meta, cid, array.nbytes) if eager is not None else None
            return action or self._single_action(cid)
        request = make_request(name, meta, array, out)
        if eager is not None:
            self._eager[cid] = request
        self._ready = bit
        self._ready_since[cid] = time.monotonic()
        return self._slow_cycle(c) if flags else self._fast_actions(ready)

    def _read_plan(self, plan):
        """Fill an ExpressPlan from the cache as it is now (see express_memo.py). plan.native: the compiled cycle
        takes it whole -- cached, a dtype and op it reduces, and eager wherever its array lies (a slot holds it, and
        it is no larger than SHARED_EAGER_BYTES, so that the transport's window does not matter)."""
        plan.cid = cid = self.cache.get((plan.name, plan.meta))
        plan.how = how = False if cid is None else self._how(cid, plan.meta)
        plan.native = bool(how) and 0 < plan.nbytes <= min(self._eager_bytes, SHARED_EAGER_BYTES)
        plan.generation = self.cache.updates
        fast = self.fast
        plan.fast = fast.record(plan.generation, cid, how) if plan.native and fast is not None else None

    def _how(self, cid, meta):
        """How the native cycle reduces cached id `cid` (made once per id; dropped when the id changes)."""
        how = self._native_how.get(cid, False)
        if how is False:
            how = self._native_how[cid] = native_cycle.reduce_how(
                meta.dtype, meta.op, result_scale(meta.op, meta.scales[1], self.size), self.size)
        return how

    def _native_cycle(self, cid, bit, array, out, meta, how=False, resumed=None):
        """The express cycle in one native call (native_cycle.py): True when it reduced the slots into `out`, else
        (cycle, flags, ready) read from the snapshot exactly as _exchange_slots returns them. how: the native
        reduce when the caller knows it (an ExpressPlan's), else False. resumed: the outcome of the compiled call
        (fast_state.py) that published this cycle already: go on from there."""
        native = self._native
        c = self._cycle + 1
        coordinator = self.coordinator
        flags = _COORDINATOR_BUSY if coordinator is not None and (coordinator.pending or coordinator.joined) else 0
        if how is False:
            how = self._how(cid, meta)
        kind, scale, divisor = how or (-1, 1.0, 1)
        self._exchange._parity = c & 1
        start = time.perf_counter()
        if resumed is not None:
            outcome = resumed
        else:
            outcome = native._call(native._ctx, c, flags, cid, self._words, array, out, kind, scale, divisor, _SPIN_NS)
        if outcome == native_cycle.NOT_YET:
            outcome = self._native_wait(c, flags, cid, out, kind, scale, divisor, start)
        if outcome == native_cycle.DONE:
            return self._native_done(c, cid)
        if outcome == native_cycle.NOT_YET:
            self._exchange.gather(c, start)
        return self._read_snapshot(c, flags, bit)

    def _native_wait(self, c, flags, cid, out, kind, scale, divisor, start):
        """A late peer, met by a caller that polls rather than sleeps (a core per rank: Watchdog.yield_s): wait in
        native rounds of YIELD_S on the cycle c already published, with the Watchdog's peer check and progress
        between rounds, for up to that patience; so the late peer's arrival finishes the call in compiled code
        (~10-30 us) rather than in the Python gather and reduce (~50-200 us, the code cold after the wait).
        Returns the last outcome: NOT_YET once the patience is spent (the gather's wait, with its stall timeout,
        goes on from there). A wait ending here counts for the stragglers as the gather's does."""
        watchdog = self.watchdog
        patience = watchdog.yield_s()
        if patience <= YIELD_S:
            return native_cycle.NOT_YET
        native, exchange = self._native, self._exchange
        what = f"agreement cycle {c}"
        words = self._words
        outcome = native_cycle.NOT_YET
        while outcome == native_cycle.NOT_YET and time.perf_counter() - start < patience:
            exchange.published(c)               # (notes who is missing: the peer this wait is for)
            watchdog.check(what)
            if watchdog.progress is not None:
                watchdog.progress()
            outcome = native._call(native._ctx, c, flags, cid, words, None, out, kind, scale, divisor, _YIELD_NS)
        if outcome != native_cycle.NOT_YET:
            exchange.wait_over(start)
        return outcome

    def _native_done(self, c, cid):
        """The native cycle c reduced `cid` (DONE): this rank is past cycle c. True."""
        self._cycle = c
        if self._touch is not None:
            self._touch(cid)
        stragglers = self.stragglers
        if stragglers is not None:
            exchange = self._exchange
            waited = exchange.waited          # (_native_wait's, as a gather's)
            if waited is not None:
                exchange.waited = None
            if waited is not None or stragglers.waiting:
                bit = 1 << cid
                stragglers.after_cycle(c, bit, bit, 0, waited, self._words)
        return True

    def _fast_actions(self, ready):
        """The ids ready on every rank, in id order: single actions first, then allreduces fused into buckets.
        The lowest ready id runs from the cycle's slots when every rank published it there."""
        singles, allreduces = [], []
        first = True
        while ready:
            low = ready & -ready
            cid = low.bit_length() - 1
            ready ^= low
            self._ready &= ~low
            del self._ready_since[cid]
            if self._touch is not None:
                self._touch(cid)
            name, meta = self.cache.keys[cid]
            req = self._eager.pop(cid, None)
            eager = first and req is not None and self._eager_action(name, meta, cid, req.arrays[0].nbytes)
            first = False
            if eager:
                singles.append(eager)
            elif meta.kind != "allreduce":
                singles.append(self._single_action(cid))
            else:
                allreduces.append((name, meta))
        if not allreduces:
            return singles
        return singles + fuse_allreduces(allreduces, self.config.fusion_threshold, self.size)

    def _single_action(self, cid):
        """The Collective of one cached id on its buffers (the same few recur every step: made once per id)."""
        action = self._single_actions.get(cid)
        if action is None:
            name, meta = self.cache.keys[cid]
            action = self._single_actions[cid] = Collective.of(meta.kind, (name,), (meta,), self.size)
        return action

    def _slow_cycle(self, c):
        """Everyone hands everything it holds to rank 0's Coordinator and runs what it sends back."""
        items = [cid for cid in self._ids_in(self._ready)] + self._handed
        self._ready, self._ready_since, self._handed, self._eager = 0, {}, [], {}
        if self.rank == 0:
            self._coordinate_items(0, items)
            pending = set(self._peers)

            def collect():
                while pending and (received := self.control.receive(TAG_TO_COORDINATOR)) is not None:
                    source, (cycle, theirs) = received
                    assert cycle == c, f"rank {source} sent cycle {cycle} items in cycle {c}"
                    self._coordinate_items(source, theirs)
                    pending.discard(source)
                return not pending

            self._wait(collect, f"agreement cycle {c}: submissions from ranks {sorted(pending)}")
            actions = self.plan_with_stall_check()
            new_cache = self.coordinator.take_new_cache_entries()
            for r in self._peers:
                self.control.send((c, actions, new_cache), r, TAG_FROM_COORDINATOR)
            self.control.progress_sends()
        else:
            self.control.send((c, items), 0, TAG_TO_COORDINATOR)
            answer = []

            def receive():
                self.control.progress_sends()
                received = self.control.receive(TAG_FROM_COORDINATOR, source=0)
                if received is None:
                    return False
                answer.append(received[1])
                return True

            self._wait(receive, f"agreement cycle {c}: the coordinator's answer")
            cycle, actions, new_cache = answer[0]
            assert cycle == c, f"coordinator answered cycle {cycle} in cycle {c}"
        self._apply_cache_changes(new_cache)
        return actions

    def _apply_cache_changes(self, changes):
        changed = super()._apply_cache_changes(changes)
        if changed:
            for cid in changed:
                self._single_actions.pop(cid, None)
                self._native_how.pop(cid, None)
                self._eager_actions.pop((cid, 0), None)
                self._eager_actions.pop((cid, 1), None)
            self._words = self.cache.highest // 64 + 1
        return changed

    def _ids_in(self, bitmap):
        while bitmap:
            low = bitmap & -bitmap
            bitmap ^= low
            yield low.bit_length() - 1

    def _coordinate_items(self, rank, items):
        submissions = [item for item in items if not (isinstance(item, tuple) and len(item) == 1)]
        if submissions:
            self.coordinator.submit(rank, submissions)
        for item in items:
            if isinstance(item, tuple) and len(item) == 1:
                self._coordinate(rank, item)

    def _wait(self, done, what):
        timeout = self.config.stall_timeout_s
        try:
            self.watchdog.wait(done, what, timeout=timeout)
        except TimeoutError:
            raise StallError(f"rank {self.rank}: no answer within {timeout:g} s in {what}") from None

    def close(self):
        """Collective over the ranks of the exchange (the window's free)."""
        if self._exchange is not None:
            self._exchange.close()
            self._exchange = None


def _eager_candidate(req):
    return express_eligible(req.meta) and len(req.arrays) == 1 and req.outs[0] is not None
