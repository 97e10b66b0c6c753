"""Who runs the engine's passes, and how each waits between them without spinning.

A caller waiting for its collective runs passes on its own thread (until()); the engine's background thread runs
them whenever no caller does (background()), so asynchronous work and peers' agreement cycles keep moving while
the caller computes. Whoever holds the engine's progress lock runs the pass (Engine._guarded_pass). Between passes
that did nothing: yield the CPU a few times, then poll every few tens of microseconds while an answer is owed,
backing off to cycle_time; with nothing in flight, sleep until a local submission rings the doorbell.
"""
import logging
import os
import time

from ..errors import ShutdownError
from .watchdog import YIELD_S

log = logging.getLogger("ringtrain")

SPIN_PASSES = 50               # passes spent yielding the CPU right after activity, before sleeping
FAST_POLL_S = 2e-5             # poll period while an answer is owed (the OS rounds it up to ~60 us)
FAST_POLLS = 200               # ... for about the first 10 ms, then back off to cycle_time
IDLE_SLEEP_S = 0.02            # background sleep with nothing in flight (wakes at once on an async submit)
OBSERVE_S = 0.1                # how often the background thread looks at the straggler scores


class Driver:
    """The pass loop of one Engine: the callers' and the background thread's."""

    def __init__(self, engine):
        self.engine = engine
        self.count = 0                  # callers currently driving (engine's state lock): the background thread
                                        # then stays out
        self._next_look = 0.0           # see _observe

    def until(self, done, deadline, first=None):
        """Run passes on the caller's thread until done() (or the deadline, or the engine's end). `first`: a
        request this caller registers itself at its first pass when no one else is running one (Engine.run)."""
        engine = self.engine
        with engine._state_lock:
            self.count += 1
        try:
            idle = 0
            lock = engine._progress_lock
            # with a core per rank, this caller polls the answer it waits for instead of sleeping (Watchdog.yield_s)
            patient_s = engine.watchdog.yield_s()
            patient_s = patient_s if patient_s > YIELD_S else 0.0
            idle_since = 0.0
            while not engine.finished.is_set() and (first is not None or not done()):
                if deadline is not None and time.monotonic() > deadline:
                    return
                if not lock.acquire(blocking=False):
                    if first is not None:     # someone is mid-pass: the request takes the queue after all
                        engine.intake.queue.put(first)
                        first = None
                    # the background thread is running a pass (likely this very collective): give it the CPU, but
                    # no OS sleep -- that would add ~60 us after it finishes
                    os.sched_yield()
                    continue
                try:
                    if first is not None:
                        if engine.fast.take():    # a caller's compiled call left its cycle to finish: no register
                            engine.intake.queue.put(first)
                        else:
                            engine._take_submissions()
                            engine._register(first)
                        first = None
                    busy = engine._guarded_pass()
                finally:
                    lock.release()
                if busy:
                    idle = 0
                else:
                    idle += 1
                    if idle == 1:
                        idle_since = time.monotonic()
                    elif patient_s and time.monotonic() - idle_since < patient_s:
                        os.sched_yield()
                        continue
                    self.idle_wait(idle, owed=True)
        finally:
            if first is not None:             # the engine stopped before the request could be registered
                engine.intake.release(first.name)
                first.handle._set_error(engine.failed or ShutdownError(
                    f"rank {engine.rank}: ringtrain was shut down before this collective completed"))
            with engine._state_lock:
                self.count -= 1
            if engine.requests or not engine.intake.queue.empty():
                engine.wake.set()     # async work remains: the background thread takes over

    def background(self):
        """The engine thread: passes whenever no caller is driving, until the engine finishes."""
        engine = self.engine
        idle = 0
        while not engine.finished.is_set():
            if self.count:
                engine.wake.wait(IDLE_SLEEP_S)     # a caller is driving; it wakes us when it leaves
                engine.wake.clear()
                self._observe()
                continue
            with engine._progress_lock:
                busy = engine._guarded_pass(background=True)
            if busy:
                idle = 0
                continue
            idle += 1
            self.idle_wait(idle, owed=bool(engine.requests or engine.join_handle or engine.agreement.owes()))
            self._observe()

    def _observe(self):
        """Between passes, at most every OBSERVE_S: the engine's look at what the job is doing (straggler scores).
        Never fatal to the engine thread: a failure there is logged."""
        now = time.monotonic()
        if now < self._next_look:
            return
        self._next_look = now + OBSERVE_S
        self.engine.fast.off()         # the straggler scores may change what an express call must report
        try:
            self.engine.observer.observe(now)
        except Exception:
            log.exception("rank %d: ringtrain could not judge the straggler scores", self.engine.rank)

    def idle_wait(self, idle, owed):
        """Nothing happened in the last pass. With work in flight an answer (or a peer's cycle) can come any moment:
        yield the CPU for a few passes, then poll every few tens of microseconds, backing off to cycle_time. With
        nothing in flight no answer is owed to us: sleep long, waking at once for a local async submission."""
        if owed:
            if idle < SPIN_PASSES:
                os.sched_yield()
                return
            delay = FAST_POLL_S if idle < FAST_POLLS else min(self.engine.config.cycle_time_ms * 1e-3,
                                                               FAST_POLL_S * (idle - FAST_POLLS + 1))
        else:
            delay = IDLE_SLEEP_S
        wake = self.engine.wake
        if wake.wait(delay):
            wake.clear()

