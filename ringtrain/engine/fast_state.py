"""A planned allreduce's whole express call in compiled code (csrc/express_fast.c), and the Python side of the state
that call keeps in the C ctx while it is armed.

    fast = FastState.open(agreement, native)     # None: no compiled cycle, or perf_counter is not CLOCK_MONOTONIC
    plan.fast = fast.record(generation, cid, how)   # what collectives.allreduce hands the C call: fast[0](fast, a, out)
    fast.attach(engine)   # the engine's stats, flight recorder, express_end, progress lock and idle state
    fast.arm()            # progress lock held, after an express call: the C ctx takes planned calls from now on
    fast.hold()           # an async allreduce held back while armed: the ctx stays armed for its wait alone
    fast.off()            # any thread, before anything else touches the agreement (submit, join, timeline...)
    fast.take()           # progress lock held: disarm and put back what the C calls did; the unresolved cycle or 0
    fast.drain()          # a reader on another thread (metrics, flight-recorder dumps): take() under the lock

The invariant: armed => no Python code touches this engine's agreement state, and that state is idle: nothing
ready, handed or dirty, rank 0's coordinator holds nothing, no straggler wait, and no request, join, open timeline,
held-back or queued submission in the engine. The GIL makes each C call atomic with respect to Python threads.
While armed the C ctx owns the cycle number, the express stats, the flight-recorder entries and rank 0's LRU uses,
and take() puts them back: agreement._cycle; rank 0's cache touches in call order (so its evictions are those that
per-call touches make); every call's stats sample (the C ring holds FAST_RING calls, and a full ring makes the C call
decline: that call goes the Python way, which takes first); every call's flight-recorder entry (name and meta from
the cache, which cannot change while armed); and the engine's express_end (perf_counter's clock: open() checks that
it is the C code's CLOCK_MONOTONIC).

A C call that published its cycle but could not finish it (a late peer: NOT_YET; a snapshot for Python to decide:
ARRIVED) disarms the ctx and leaves that cycle *unresolved*: its caller finishes it in Python (Engine.express(...,
resumed=outcome)); meanwhile no pass runs and no other express call starts. A caller that never comes back (an
exception in between) must not hang the job: take(in_pass=True) raises a StallError naming the call once a cycle has
been unresolved for stall_timeout_s.
"""
import time
from functools import partial

from ..errors import StallError
from . import native_cycle

CLOCK = "clock_gettime(CLOCK_MONOTONIC)"     # the C code's clock (express_ctx.h's now_ns)
_SPIN_NS = int(native_cycle.SPIN_S * 1e9)


class NoFast:
    """An engine whose agreement has no compiled call: nothing to arm, take or drain."""
    on = False

    def attach(self, engine):
        pass

    def off(self):
        pass

    def take(self, in_pass=False):
        return 0

    def drain(self, blocking=True):
        pass

    def arm(self):
        return False

    def hold(self):
        return False

    def resolved(self):
        pass


NO_FAST = NoFast()


class FastState:
    """One agreement's planned C call: arm, off, take (drain), and the records its plans carry."""

    def __init__(self, agreement, module, ctx):
        self._agreement = agreement
        self._module = module
        self._fast = module.fast
        self._ctx = ctx
        self._disarm = module.fast_disarm
        self._engine = None
        self._unresolved_since = None    # (cycle, time.monotonic()) an unresolved cycle was first seen
        self._recorded = 0               # the flight recorder's last seq when the ctx was armed
        # hold(): an async allreduce is being held back (held.py): True when the ctx was armed -- the engine is idle,
        # as holding needs -- and stays armed for that call's wait alone (fast(..., held)); False: not armed.
        # off(): disarm only (any thread): the ctx takes no call until the next arm; take() drains later.
        self.hold = partial(module.fast_hold, ctx)       # (C calls with no Python frame: both are on hot paths)
        self.off = partial(module.fast_disarm, ctx, 0)
        self.on = True                   # a test's switch: off, nothing is armed (the Python path alone)
        self.stub = 0                    # a harness's switch: the armed C call skips the window (DONE at once)

    @classmethod
    def open(cls, agreement, native):
        """native: the agreement's NativeCycle (or None). None when there is none, or when perf_counter's clock is
        not the one the C code stamps its calls with."""
        if native is None or time.get_clock_info("perf_counter").implementation != CLOCK:
            return None
        return cls(agreement, native_cycle.library(), native._ctx)

    def attach(self, engine):
        self._engine = engine

    def record(self, generation, cid, how):
        """A plan's record (read at cache generation `generation`): what the C call needs of it."""
        return (self._fast, self._ctx, generation, cid, how[0], how[1], how[2])

    def arm(self):
        """Progress lock held, after an express call: arm the C ctx when the engine and its agreement are idle."""
        agreement, engine = self._agreement, self._engine
        if not self.on or agreement._native is None or agreement._ready or agreement._handed or agreement._dirty:
            return False
        coordinator = agreement.coordinator
        if coordinator is not None and (coordinator.pending or coordinator.joined):
            return False
        stragglers = agreement.stragglers
        if stragglers is not None and stragglers.waiting:
            return False
        timeline = engine.executor.timeline
        intake = engine.intake
        if (engine.requests or engine.join_handle is not None or engine.closed or intake.deferred is not None
                or (timeline is not None and not timeline.closed) or not intake.queue.empty()):
            return False
        self._recorded = engine.recorder.seq      # the C calls' flight-recorder entries come after this one
        return self._module.fast_arm(self._ctx, agreement._cycle, agreement.cache.updates, agreement._words,
                                     _SPIN_NS, self.stub)

    def resolved(self):
        """The caller finished its unresolved cycle (progress lock held)."""
        self._module.fast_resolved(self._ctx)

    def take(self, in_pass=False):
        """Progress lock held: disarm the C ctx and put back what its calls did (see the module docstring). Returns
        the cycle a C call published and left to its caller to finish (0: none). in_pass: an engine pass, which
        raises StallError when that cycle has been unresolved for stall_timeout_s."""
        got = self._disarm(self._ctx)
        if got is None:
            return 0
        cycle, unresolved, unresolved_cid, last_end, count, nbytes, ns, cids, starts, ends = got
        agreement = self._agreement
        agreement._cycle = cycle
        if count:
            self._book(agreement, count, nbytes, ns, cids, starts, ends, last_end)
        if not unresolved:
            self._unresolved_since = None
            return 0
        since = self._unresolved_since
        now = time.monotonic()
        if since is None or since[0] != unresolved:
            self._unresolved_since = since = (unresolved, now)
        timeout = agreement.config.stall_timeout_s
        if in_pass and now - since[1] > timeout:
            name = agreement.cache.keys[unresolved_cid][0]
            raise StallError(f"rank {agreement.rank}: the allreduce {name!r} published agreement cycle {unresolved} "
                             f"in its compiled express call and its caller has not finished that cycle for "
                             f"{timeout:g} s (an exception between the compiled call and Engine.express?)")
        return unresolved

    def _book(self, agreement, count, nbytes, ns, cids, starts, ends, last_end):
        """The drained calls into rank 0's LRU, the stats, the flight recorder and express_end."""
        touch = agreement._touch
        if touch is not None:         # each id once, in the order of its last use: the order per-call touches leave
            for cid in reversed(list(dict.fromkeys(reversed(cids)))):
                touch(cid)
        engine = self._engine
        module = self._module
        engine._express_stats.add_many(count, nbytes, ns * 1e-9, module.fast_durations(starts, ends))
        engine.recorder.add_finished(agreement.cache.keys, cids, starts, ends, self._recorded, module.fast_record)
        end = last_end * 1e-9
        if end > engine.express_end:
            engine.express_end = end

    def drain(self, blocking=True):
        """From outside a pass: book the C calls first (a reader of the stats or the flight recorder; a submission,
        whose flight-recorder entry must come after theirs). blocking=False (a submission; a signal handler, which
        may have interrupted the lock's holder): only disarm when the lock is taken -- its holder took already."""
        lock = self._engine._progress_lock
        if lock.acquire(blocking):
            try:
                self.take()
            finally:
                lock.release()
        else:
            self.off()
