"""The Coordinator's protocol: every decision through rank 0, asynchronously (Horovod's original protocol).

Every request goes to rank 0 -- full metadata the first time, a cache id after that -- and rank 0's Coordinator
(negotiation.py) answers with the actions; the messages travel on the engine's control channel (control.py).
make_agreement (agreement.py) gives it to a job of more than MESSAGE_CYCLE_MAX_RANKS ranks across nodes; at one rank
solo.py's SoloAgreement extends it with a cycle-free express path, and cycle_agreement.py's CycleAgreement extends it
with the cycles (its slow cycle hands everything to this Coordinator).
"""
import time

from .control import TAG_FROM_COORDINATOR, TAG_TO_COORDINATOR
from .model import Warn
from .negotiation import Coordinator
from .response_cache import CacheView

STALL_CHECK_PERIOD_S = 0.5


class CoordinatorAgreement:
    """Every decision through rank 0, asynchronously: ranks send what they submit, rank 0 answers with actions."""

    synchronous = False              # ranks name cache ids in messages at any time (see response_cache.py)
    fast = None                      # the planned call in compiled code (fast_state.py): cycles on a window only

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

    def express(self, name, meta, array, out, make_request, plan=None, resumed=None):
        """No express path when every decision goes through rank 0 (see cycle_agreement.CycleAgreement.express)."""
        return None

    def _flush_items(self):
        if self._items:
            # the ids in items mean what they meant after this many cache updates (rank 0 keeps evicted ids
            # resolvable until every rank has said it applied the update that evicted them)
            self._outbox.append(("submit", self._items, self.cache.updates))
            self._items = []

    # ---- progress --------------------------------------------------------------------------------------------
    def poll(self, lazy=False):
        """This rank's agreed actions so far (lazy: see cycle_agreement.CycleAgreement.poll; no cycles here)."""
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
