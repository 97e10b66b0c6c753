"""How the ranks agree on what to run next: the control-message layer around the Coordinator (negotiation.py).

Two implementations of one small interface, chosen from the topology:

  add(request) / add_control("join" | "shutdown")   what this rank has newly submitted
  poll() -> [Action]                                 the next agreed actions; the same list, in the same order,
                                                     on every rank
  owes() -> bool                                     something is pending that a peer may answer soon

CoordinatorAgreement (ranks on several nodes): every request goes to rank 0 -- full metadata the first time,
a cache id after that -- and rank 0 answers with the actions (Horovod's original protocol).

SharedWindowAgreement (one node): the steady state needs no rank 0. Ranks agree in *cycles* through a small MPI
shared-memory window. Each rank's slot holds a cycle number and, for the two parities of the cycle number, a flag
word and a bitmap of the cache ids it has ready. Entering cycle c: write flags + bitmap into slot (c % 2), then
publish c; wait until every rank has published c; read every rank's slot (c % 2). Every rank thereby reads the
same snapshot, so every rank computes the same decision with no message:
  - no flags anywhere: run the ids set on EVERY rank, in id order, fused into buckets by a pure function;
  - any flag (a first sighting, join, shutdown, a request pending too long, or rank 0's coordinator still holding
    something): a *slow cycle* -- every rank hands everything it holds to rank 0's Coordinator over MPI and
    executes the actions it sends back, exactly as the coordinator protocol does; mismatch, stall and join
    handling (and their messages) are the Coordinator's.
Why two parities suffice: a peer can write slot (c % 2) again only in cycle c + 2, which it can enter only after
this rank published c + 1, i.e. after this rank finished reading cycle c.

Eager small allreduces: a slot also carries the data of this rank's lowest pending small host allreduce (<= 64 KB,
one array, no prescale) and its id. When the lowest ready id is such an allreduce and EVERY rank published that id,
every rank reduces the published copies in rank order (bitwise the same result everywhere) straight into its
output during the cycle: the agreement barrier is the only synchronisation a small allreduce pays.
A rank enters the next cycle when it has something new, when a peer has entered it (the engine thread looks at
the peers' cycle numbers even while idle), or, on rank 0, when the Coordinator's stall check is due. Nothing new
anywhere means nobody cycles: no busy loop.
"""
import logging
import time

import numpy as np
from mpi4py import MPI

from . import ops
from .errors import StallError
from .negotiation import CACHE_CAPACITY, SAME_EVERYWHERE, Action, Coordinator, fuse_allreduces

log = logging.getLogger("ringtrain")

TAG_TO_COORDINATOR = 11
TAG_FROM_COORDINATOR = 12
STALL_CHECK_PERIOD_S = 0.5


class CoordinatorAgreement:
    """Every decision through rank 0, asynchronously: ranks send what they submit, rank 0 answers with actions."""

    def __init__(self, ctrl, config, watchdog):
        self.ctrl, self.config, self.watchdog = ctrl, config, watchdog
        self.rank, self.size = ctrl.Get_rank(), ctrl.Get_size()
        self.coordinator = (Coordinator(self.size, config.fusion_threshold, config.stall_warning_s,
                                        config.stall_timeout_s) if self.rank == 0 else None)
        self.cache = {}                  # (name, Meta) -> id assigned by rank 0, the same on every rank
        self._sends = []                 # outstanding isends on ctrl
        self._outbox = []                # messages for the coordinator not yet sent
        self._items = []                 # submissions not yet in a message
        self._next_stall_check = time.monotonic() + STALL_CHECK_PERIOD_S

    # ---- input -----------------------------------------------------------------------------------------------
    def add(self, req):
        key = (req.name, req.meta)
        self._items.append(self.cache.get(key, key))

    def add_control(self, kind):
        self._flush_items()
        self._outbox.append((kind,))

    def _flush_items(self):
        if self._items:
            self._outbox.append(("submit", self._items))
            self._items = []

    # ---- progress --------------------------------------------------------------------------------------------
    def poll(self):
        self._flush_items()
        for message in self._outbox:
            self._to_coordinator(message)
        self._outbox = []
        if self.rank == 0:
            self._receive_submissions()
            actions = self.plan_with_stall_check()
            if actions:
                new_cache = self.coordinator.take_new_cache_entries()
                for r in range(1, self.size):
                    self._isend(("actions", actions, new_cache), r, TAG_FROM_COORDINATOR)
                self.cache.update(new_cache)
        else:
            actions = []
            while self.ctrl.iprobe(source=0, tag=TAG_FROM_COORDINATOR):
                _, more, new_cache = self.ctrl.recv(source=0, tag=TAG_FROM_COORDINATOR)
                self.cache.update(new_cache)
                actions.extend(more)
        self.progress_sends()
        return actions

    def plan_with_stall_check(self, force_check=False):
        """Rank 0: the Coordinator's plan, preceded by stall warnings; a fatal stall replaces it by an abort."""
        actions = self.coordinator.plan()
        now = time.monotonic()
        if force_check or now > self._next_stall_check:
            self._next_stall_check = now + STALL_CHECK_PERIOD_S
            warnings, fatal = self.coordinator.check_stalls()
            if fatal:
                return [Action("abort", message=fatal)]
            actions = [Action("warn", message=w) for w in warnings] + actions
        return actions

    def owes(self):
        return self.coordinator is not None and bool(self.coordinator.pending or self.coordinator.joined)

    def _to_coordinator(self, message):
        if self.rank == 0:
            self._coordinate(0, message)
        else:
            self._isend(message, 0, TAG_TO_COORDINATOR)

    def _coordinate(self, rank, message):
        kind = message[0]
        if kind == "submit":
            self.coordinator.submit(rank, message[1])
        elif kind == "join":
            self.coordinator.join(rank)
        elif kind == "shutdown":
            self.coordinator.shutdown(rank)

    def _receive_submissions(self):
        status = MPI.Status()
        while self.ctrl.iprobe(source=MPI.ANY_SOURCE, tag=TAG_TO_COORDINATOR, status=status):
            source = status.Get_source()
            self._coordinate(source, self.ctrl.recv(source=source, tag=TAG_TO_COORDINATOR))

    def _isend(self, message, dest, tag):
        # never a blocking send: the destination may be busy in a ring step that needs us
        self._sends.append(self.ctrl.isend(message, dest=dest, tag=tag))

    def progress_sends(self):
        """Test outstanding sends: MPI moves a large (rendezvous) message only while the sender calls into MPI."""
        if self._sends:
            self._sends = [r for r in self._sends if not r.Test()]

    def close(self):
        pass


# flag bits of a cycle slot
_WANTS_COORDINATOR = 1      # this rank has first sightings, join/shutdown, or a request pending too long
_COORDINATOR_BUSY = 2       # rank 0: the Coordinator still holds undecided requests or joined ranks
_WORDS = CACHE_CAPACITY // 64
_SLOT = 1 + _WORDS          # int64 words: flags, bitmap
_LINE = 64
EAGER_BYTES = 64 << 10      # small allreduces travel with the cycle: [id, nbytes] + data per parity
_EAGER_SLOT = _LINE + EAGER_BYTES
HANDOVER_S = 0.5            # a cached request not ready everywhere for this long goes to the Coordinator, which
                            # names the missing ranks in its stall warnings and errors


class SharedWindowAgreement(CoordinatorAgreement):
    """One node: cached collectives are agreed through a shared window; the rest through the Coordinator."""

    def __init__(self, ctrl, node, config, watchdog):
        super().__init__(ctrl, config, watchdog)
        if node.Get_size() != self.size:
            raise ValueError("SharedWindowAgreement needs every rank on one node")
        self._node = node
        self._ids = {}                   # cache id -> (name, Meta), for ids usable on the fast path
        self._ready = 0                  # bitmap (Python int) of this rank's fast-path ids
        self._ready_since = {}           # id -> time it was submitted (handover to the coordinator when old)
        self._handed = []                # items held for the next slow cycle
        self._dirty = False              # something new since the last cycle
        self._cycle = 0
        control = -(-(8 + 2 * _SLOT * 8) // _LINE) * _LINE
        per_rank = control + 2 * _EAGER_SLOT
        self._win = MPI.Win.Allocate_shared(per_rank, 1, comm=node)
        self._win.Lock_all(MPI.MODE_NOCHECK)
        views = []
        for p in range(self.size):
            mem, _ = self._win.Shared_query(p)
            views.append(np.frombuffer(mem, dtype=np.uint8, count=per_rank))
        words = [v[:control].view(np.int64) for v in views]
        self._seqs = [w[0:1] for w in words]                 # cycle number of each rank
        self._slots = [(w[1:1 + _SLOT], w[1 + _SLOT:1 + 2 * _SLOT]) for w in words]
        self._eager_slots = [(v[control:control + _EAGER_SLOT], v[control + _EAGER_SLOT:control + 2 * _EAGER_SLOT])
                             for v in views]
        self._eager = {}                 # id -> Request that may travel eagerly (small host allreduce)
        views[self.rank][:] = 0
        self._peers = [p for p in range(self.size) if p != self.rank]
        self._win.Sync()
        node.Barrier()
        self._win.Sync()

    # ---- input -----------------------------------------------------------------------------------------------
    def add(self, req):
        key = (req.name, req.meta)
        cid = self.cache.get(key)
        if cid is not None and req.meta.kind in SAME_EVERYWHERE:
            self._ids[cid] = key
            if _eager_candidate(req):
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
    def poll(self):
        if not self._should_enter():
            return []
        return self._run_cycle()

    def _should_enter(self):
        if self._dirty:
            return True
        for p in self._peers:
            if self._seqs[p][0] > self._cycle:
                return True
        now = time.monotonic()
        if self._ready and min(self._ready_since.values()) < now - HANDOVER_S:
            return True
        return self.rank == 0 and super().owes() and now > self._next_stall_check

    def _run_cycle(self):
        c = self._cycle + 1
        parity = c % 2
        now = time.monotonic()
        wants = bool(self._handed) or (self._ready and min(self._ready_since.values()) < now - HANDOVER_S)
        flags = (_WANTS_COORDINATOR if wants else 0) | (_COORDINATOR_BUSY if self.rank == 0 and super().owes() else 0)
        slot = self._slots[self.rank][parity]
        slot[0] = flags
        slot[1:] = np.frombuffer(self._ready.to_bytes(_WORDS * 8, "little"), dtype=np.int64)
        self._publish_eager(parity)
        self._win.Sync()
        self._seqs[self.rank][0] = c
        self._wait_for_peers(c)
        self._win.Sync()
        self._cycle, self._dirty = c, False
        any_flags = flags
        ready = self._ready
        for p in self._peers:
            theirs = self._slots[p][parity]
            any_flags |= int(theirs[0])
            if ready:
                ready &= int.from_bytes(theirs[1:].tobytes(), "little")
        if any_flags:
            return self._slow_cycle(c)
        return self._fast_actions(ready, parity)

    def _wait_for_peers(self, c):
        seqs, timeout = self._seqs, self.config.stall_timeout_s
        missing = self.watchdog.wait_for_all(self._peers, lambda p: seqs[p][0] >= c, f"agreement cycle {c}", timeout)
        if missing:
            raise StallError(f"rank {self.rank}: ranks {missing} did not reach agreement cycle {c} within "
                             f"{timeout:g} s (their engines stopped answering)")

    def _publish_eager(self, parity):
        """Our lowest pending eager-able request's id and data into this cycle's eager slot (or id -1)."""
        header = self._eager_slots[self.rank][parity][:16].view(np.int64)
        if not self._eager:
            header[0] = -1
            return
        cid = min(self._eager)
        array = self._eager[cid].arrays[0]
        header[0], header[1] = cid, array.nbytes
        self._eager_slots[self.rank][parity][_LINE:_LINE + array.nbytes].view(array.dtype).reshape(array.shape)[...] \
            = array

    def _run_eager(self, cid, parity):
        """If every rank published `cid`, reduce the published copies into our output; True when done."""
        req = self._eager.get(cid)
        if req is None:
            return False
        nbytes = req.arrays[0].nbytes
        for p in range(self.size):
            header = self._eager_slots[p][parity][:16].view(np.int64)
            if header[0] != cid or header[1] != nbytes:
                return False
        meta, out = req.meta, req.outs[0].reshape(-1)
        dtype = out.dtype
        data = [self._eager_slots[p][parity][_LINE:_LINE + nbytes].view(dtype) for p in range(self.size)]
        ufunc = ops.UFUNCS[meta.op]
        ufunc(data[0], data[1], out=out)
        for p in range(2, self.size):
            ufunc(out, data[p], out=out)
        postscale = meta.scales[1]
        scale = postscale / self.size if meta.op == ops.ReduceOp.AVERAGE else postscale
        if scale != 1.0:
            ops.scale_into(out, out, scale)
        return True

    def _fast_actions(self, ready, parity):
        """The ids ready on every rank, in id order: single actions first, then allreduces fused into buckets.
        The lowest ready id may already have been reduced eagerly from the slots (Action extra ("eager",))."""
        singles, allreduces = [], []
        first = True
        while ready:
            low = ready & -ready
            cid = low.bit_length() - 1
            ready ^= low
            self._ready &= ~low
            del self._ready_since[cid]
            name, meta = self._ids[cid]
            eager = first and self._run_eager(cid, parity)
            first = False
            self._eager.pop(cid, None)
            if eager:
                singles.append(Action("allreduce", (name,), (meta,), extra=("eager",)))
            elif meta.kind == "allreduce":
                allreduces.append((name, meta))
            else:
                singles.append(Action(meta.kind, (name,), (meta,)))
        return singles + fuse_allreduces(allreduces, self.config.fusion_threshold)

    def _slow_cycle(self, c):
        """Everyone hands everything it holds to rank 0's Coordinator and runs what it sends back."""
        items = [cid for cid in self._ids_in(self._ready)] + self._handed
        self._ready, self._ready_since, self._handed, self._eager = 0, {}, [], {}
        if self.rank == 0:
            self._coordinate_items(0, items)
            pending = set(self._peers)
            status = MPI.Status()

            def collect():
                while pending and self.ctrl.iprobe(source=MPI.ANY_SOURCE, tag=TAG_TO_COORDINATOR, status=status):
                    source = status.Get_source()
                    cycle, theirs = self.ctrl.recv(source=source, tag=TAG_TO_COORDINATOR)
                    assert cycle == c, f"rank {source} sent cycle {cycle} items in cycle {c}"
                    self._coordinate_items(source, theirs)
                    pending.discard(source)
                return not pending

            self._wait(collect, f"agreement cycle {c}: submissions from ranks {sorted(pending)}")
            actions = self.plan_with_stall_check()
            new_cache = self.coordinator.take_new_cache_entries()
            for r in self._peers:
                self._isend((c, actions, new_cache), r, TAG_FROM_COORDINATOR)
            self.progress_sends()
        else:
            self._isend((c, items), 0, TAG_TO_COORDINATOR)
            answer = []

            def receive():
                self.progress_sends()
                if not self.ctrl.iprobe(source=0, tag=TAG_FROM_COORDINATOR):
                    return False
                answer.append(self.ctrl.recv(source=0, tag=TAG_FROM_COORDINATOR))
                return True

            self._wait(receive, f"agreement cycle {c}: the coordinator's answer")
            cycle, actions, new_cache = answer[0]
            assert cycle == c, f"coordinator answered cycle {cycle} in cycle {c}"
        self.cache.update(new_cache)
        return actions

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
        """Collective over the node: frees the window."""
        if self._win is not None:
            self._seqs = self._slots = self._eager_slots = None
            self._win.Unlock_all()
            self._win.Free()
            self._win = None


def _eager_candidate(req):
    meta = req.meta
    return (meta.kind == "allreduce" and meta.device == "cpu" and len(req.arrays) == 1 and meta.scales[0] == 1.0
            and req.outs[0] is not None and 0 < req.arrays[0].nbytes <= EAGER_BYTES)


def make_agreement(topology, ctrl, config, watchdog):
    if topology.single_node and topology.size > 1:
        return SharedWindowAgreement(ctrl, topology.local, config, watchdog)
    return CoordinatorAgreement(ctrl, config, watchdog)
