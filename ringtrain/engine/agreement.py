"""How the ranks agree on what to run next, around the Coordinator (negotiation.py); the messages travel on the
engine's control channel (control.py).

Two implementations of one small interface, chosen from the topology:

  add(request) / add_control("join" | "shutdown")   what this rank has newly submitted
  poll() -> [Action]                                 the next agreed actions; the same list, in the same order,
                                                     on every rank
  owes() -> bool                                     something is pending that a peer may answer soon

CoordinatorAgreement (more ranks than MESSAGE_CYCLE_MAX_RANKS; at one rank solo.py's SoloAgreement, which adds a
cycle-free express path): every request goes to rank 0 -- full metadata the first time, a cache id after that -- and
rank 0 answers with the actions (Horovod's original protocol).

CycleAgreement (everything else): the steady state needs no rank 0. Ranks agree in *cycles*: in cycle c each rank
publishes a slot -- a flag word and a bitmap of the cache ids it has ready -- and waits until it holds every rank's
cycle-c slot (cycle_exchange.py moves the slots: a shared window on one node, one message per peer across nodes).
Every rank thereby reads the same snapshot, so every rank computes the same decision with no further message:
  - no flags anywhere: run the ids set on EVERY rank, in id order, fused into buckets by a pure function;
  - any flag (a first sighting, join, shutdown, a request pending too long, or rank 0's coordinator still holding
    something): a *slow cycle* -- every rank hands everything it holds to rank 0's Coordinator over MPI and
    executes the actions it sends back, exactly as the coordinator protocol does; mismatch, stall and join
    handling (and their messages) are the Coordinator's.

Eager small allreduces: a slot also carries the data of this rank's lowest pending small host allreduce (one
array, no prescale; up to window_eager_bytes(N) on one node -- 1 MB for 2 ranks, 512 KB for 4 -- and 64 KB across
nodes; an array in the transport's shared window only up to SHARED_EAGER_BYTES) and its id. When the lowest ready
id is such an allreduce and EVERY rank published that id, its Collective says so (source SLOTS, with the slots'
views) and the executor reduces the published copies in rank order (bitwise the same result everywhere) straight
into its output before this rank enters another cycle: the agreement exchange is the only synchronisation a small
allreduce pays. The agreement itself never touches tensor data: it only decides (typed actions, model.py).
Express: a synchronous cached host allreduce with nothing else pending on this rank skips the request machinery
altogether (express()): one cycle on the caller's thread, then the executor (from the slots or the transport).
A rank enters the next cycle when it has something new, when a peer has entered it (the engine thread looks for
that even while idle), or, on rank 0, when the Coordinator's stall check is due. Nothing new anywhere means nobody
cycles: no busy loop.
"""
import time

from .control import TAG_FROM_COORDINATOR, TAG_TO_COORDINATOR
from .cycle_exchange import MESSAGE_CYCLE_MAX_RANKS, MessageExchange, WindowExchange
from .model import Collective, Source, Warn, express_eligible
from ..errors import StallError
from .negotiation import SAME_EVERYWHERE, Coordinator, fuse_allreduces
from ..ops import DTYPES, result_scale
from . import native_cycle
from .response_cache import CacheView
from ..transports.segments import Segments

STALL_CHECK_PERIOD_S = 0.5


class CoordinatorAgreement:
    """Every decision through rank 0, asynchronously: ranks send what they submit, rank 0 answers with actions."""

    synchronous = False              # ranks name cache ids in messages at any time (see response_cache.py)

    def __init__(self, control, config, watchdog, cache_capacity):
        self.control, self.config, self.watchdog = control, config, watchdog
        self.rank, self.size = control.rank, control.size
        self.coordinator = (Coordinator(self.size, config.fusion_threshold, config.stall_warning_s,
                                        config.stall_timeout_s, cache_capacity=cache_capacity,
                                        synchronous=self.synchronous) if self.rank == 0 else None)
        self.cache = CacheView()         # (name, Meta) -> id assigned by rank 0, the same on every rank
        self._outbox = []                # messages for the coordinator not yet sent
        self._items = []                 # submissions not yet in a message
        self._next_stall_check = time.monotonic() + STALL_CHECK_PERIOD_S

    # ---- input -----------------------------------------------------------------------------------------------
    def add(self, req):
        key = (req.name, req.meta)
        cid = self.cache.get(key)
        self._items.append(key if cid is None else cid)

    def add_control(self, kind):
        self._flush_items()
        self._outbox.append((kind,))

    def express(self, name, meta, array, out, make_request, plan=None):
        """No express path when every decision goes through rank 0 (see CycleAgreement.express)."""
        return None

    def _flush_items(self):
        if self._items:
            # the ids in items mean what they meant after this many cache updates (rank 0 keeps evicted ids
            # resolvable until every rank has said it applied the update that evicted them)
            self._outbox.append(("submit", self._items, self.cache.updates))
            self._items = []

    # ---- progress --------------------------------------------------------------------------------------------
    def poll(self, lazy=False):
        """This rank's agreed actions so far (lazy: see CycleAgreement.poll; no cycles here)."""
        self._flush_items()
        for message in self._outbox:
            self._to_coordinator(message)
        self._outbox = []
        if self.rank == 0:
            self._receive_submissions()
            actions = self.plan_with_stall_check()
            if actions:
                changes = self.coordinator.take_new_cache_entries()
                for r in range(1, self.size):
                    self.control.send(("actions", actions, changes), r, TAG_FROM_COORDINATOR)
                self._apply_cache_changes(changes)
        else:
            actions = []
            while (received := self.control.receive(TAG_FROM_COORDINATOR, source=0)) is not None:
                _, more, changes = received[1]
                self._apply_cache_changes(changes)
                actions.extend(more)
        self.control.progress_sends()
        return actions

    def plan_with_stall_check(self, force_check=False):
        """Rank 0: the Coordinator's plan, preceded by stall warnings and followed by the names a fatal stall
        ends (a Failed action: every rank drops them and raises StallError where it holds them)."""
        actions = self.coordinator.plan()
        now = time.monotonic()
        if force_check or now > self._next_stall_check:
            self._next_stall_check = now + STALL_CHECK_PERIOD_S
            warnings, stalled = self.coordinator.check_stalls()
            actions = [Warn(w) for w in warnings] + actions
            if stalled is not None:
                actions.append(stalled)
        return actions

    def owes(self):
        return self.coordinator is not None and bool(self.coordinator.pending or self.coordinator.joined)

    def _to_coordinator(self, message):
        if self.rank == 0:
            self._coordinate(0, message)
        else:
            self.control.send(message, 0, TAG_TO_COORDINATOR)

    def _apply_cache_changes(self, changes):
        """Every rank, in the order rank 0 made them; returns the ids whose meaning changed."""
        return self.cache.apply(changes)

    def _coordinate(self, rank, message):
        kind = message[0]
        if kind == "submit":
            self.coordinator.submit(rank, message[1], message[2])
        elif kind == "join":
            self.coordinator.join(rank)
        elif kind == "shutdown":
            self.coordinator.shutdown(rank)

    def _receive_submissions(self):
        while (received := self.control.receive(TAG_TO_COORDINATOR)) is not None:
            self._coordinate(*received)

    def close(self):
        pass


# flag bits of a cycle slot
_WANTS_COORDINATOR = 1      # this rank has first sightings, join/shutdown, or a request pending too long
_COORDINATOR_BUSY = 2       # rank 0: the Coordinator still holds undecided requests or joined ranks
EAGER_BYTES = 64 << 10      # across nodes: a slot, eager data included, travels to every peer as a message
WINDOW_EAGER_BYTES = 2 << 20    # on one node the slots are shared memory: eager up to this / N (64 KB .. 1 MB)
SHARED_EAGER_BYTES = 512 << 10  # ... except arrays in the transport's shared window: eager only up to this
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
    def express(self, name, meta, array, out, make_request, plan=None):
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
        if self._ready or self._handed or self._dirty or not array.nbytes:
            return None
        if plan is None:
            cid = self.cache.get((name, meta))
            how = False
        else:
            if plan.generation != self.cache.updates:
                self._read_plan(plan)
            cid, how = plan.cid, plan.how
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
        """Fill an ExpressPlan from the cache as it is now (see express_memo.py)."""
        plan.cid = cid = self.cache.get((plan.name, plan.meta))
        plan.how = False if cid is None else self._how(cid, plan.meta)
        plan.generation = self.cache.updates

    def _how(self, cid, meta):
        """How the native cycle reduces cached id `cid` (made once per id; dropped when the id changes)."""
        how = self._native_how.get(cid, False)
        if how is False:
            how = self._native_how[cid] = native_cycle.reduce_how(
                meta.dtype, meta.op, result_scale(meta.op, meta.scales[1], self.size), self.size)
        return how

    def _native_cycle(self, cid, bit, array, out, meta, how=False):
        """The express cycle in one native call (native_cycle.py): True when it reduced the slots into `out`, else
        (cycle, flags, ready) read from the snapshot exactly as _exchange_slots returns them. how: the native
        reduce when the caller knows it (an ExpressPlan's), else False."""
        exchange = self._exchange
        c = self._cycle + 1
        coordinator = self.coordinator
        flags = _COORDINATOR_BUSY if coordinator is not None and (coordinator.pending or coordinator.joined) else 0
        if how is False:
            how = self._how(cid, meta)
        start = time.perf_counter()
        outcome = exchange.express(c, flags, cid, self._words, array, out, how)
        if outcome == native_cycle.DONE:
            self._cycle = c
            if self._touch is not None:
                self._touch(cid)
            if self.stragglers is not None and self.stragglers.waiting:
                self.stragglers.after_cycle(c, bit, bit, 0, None, self._words)
            return True
        if outcome == native_cycle.NOT_YET:
            exchange.gather(c, start)
        return self._read_snapshot(c, flags, bit)

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


def window_eager_bytes(size):
    """How large an allreduce may travel in the cycle's shared-memory slots on one node of `size` ranks. Eager costs
    one synchronisation instead of three (the cycle, then the transport's two) but every rank reads all N copies, so
    the limit falls with N. Measured on 2 cores, private float32, against the express cycle followed by the
    transport (same-run A/B): 2 ranks eager wins at 512 KB and 1 MB (154-173 vs 258-306 us; 239-251 vs 288-395)
    and loses at 2 MB (390-500 vs 321-446); 4 ranks it wins at 512 KB and ties at 1 MB. The 1/N rule beyond 4
    ranks is that traffic argument, not a measurement."""
    limit = max(EAGER_BYTES, WINDOW_EAGER_BYTES // max(size, 1))
    return limit // 4096 * 4096        # whole pages: slots stay aligned for any dtype and for the cache


def make_agreement(topology, control, config, watchdog, copy_in, shared=None):
    """One node: cycles through a shared window. Several nodes: cycles through messages, up to
    MESSAGE_CYCLE_MAX_RANKS ranks (each cycle costs N - 1 messages per rank); beyond that the coordinator.
    shared(array): does the host transport reduce this array where it lies (see CycleAgreement._eager_fits)?
    copy_in(slot, array): the executor's copy of an eager allreduce's data into this rank's slot."""
    # rank 0 assigns the ids, and every rank's slots must hold its bitmaps: rank 0's capacity is the job's
    capacity = max(0, int(control.ctrl.bcast(config.cache_capacity, root=0)))
    if topology.size == 1:
        return CoordinatorAgreement(control, config, watchdog, capacity)
    words = max(1, -(-capacity // 64))
    if topology.single_node:
        exchange = WindowExchange(topology.local, config, watchdog, words, window_eager_bytes(topology.size),
                                  copy_in, native=config.native)
    elif topology.size <= MESSAGE_CYCLE_MAX_RANKS:
        exchange = MessageExchange(control.ctrl, config, watchdog, words, EAGER_BYTES, copy_in)
    else:
        return CoordinatorAgreement(control, config, watchdog, capacity)
    return CycleAgreement(control, exchange, config, watchdog, capacity, shared)
