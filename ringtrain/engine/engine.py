"""The engine: takes the collectives this rank submits, gets the ranks to agree on them, and runs them.

    caller ──submit()──► queue ─┐
                                ├─ one *pass* (under the progress lock): take new requests from the queue,
    handle.wait() ── drive() ───┤    agreement.poll() -> agreed Actions (agreement.py), run each (executor.py)
                                │
    background thread ──────────┘  the same passes whenever no caller is driving (async work, backward overlap)

Whoever holds the progress lock runs the pass, so MPI is only ever called by one thread at a time
(MPI_THREAD_SERIALIZED is enough). A synchronous collective is driven on the caller's own thread (run()): no
hand-off to the engine thread and no OS wake-up on the way back, and when no pass is running it skips the queue.
A synchronous host allreduce with nothing else in flight goes further (express()): one agreement cycle on the
caller's thread, then the reduction -- from the cycle's slots when it fits them, else the transport call itself --
with no request, handle or action at all; when that cycle's snapshot says anything else it becomes an ordinary
request then and there. A small asynchronous allreduce submitted while nothing else is in flight is held back
(submit()) so that a prompt wait() runs it the express way too; anything else hands it to the engine. The
background thread keeps asynchronous collectives moving while the caller computes, and follows peers into
agreement cycles while this rank is idle.

Every wait is a polled wait through the Watchdog, so a dead peer, a stall or an abort ends in an error naming
ranks and tensors, never a hang.
"""
import atexit
import logging
import os
import queue
import sys
import threading
import time

from mpi4py import MPI

from .. import errors
from .agreement import make_agreement
from .model import Collective, Failed, JoinDone, Shutdown, Warn, express_eligible
from ..errors import RankFailureError, RingtrainError, ShutdownError, StallError
from .executor import Executor
from .fusion import HOST_OPS
from .handle import Handle
from .request import Request
from ..transports.segments import Segments
from .watchdog import YIELD_S, Watchdog

log = logging.getLogger("ringtrain")

DEAD_PEER_EXIT_GRACE_S = 5.0
SPIN_PASSES = 50               # passes spent yielding the CPU right after activity, before sleeping
FAST_POLL_S = 2e-5             # poll period while an answer is owed (the OS rounds it up to ~60 us)
FAST_POLLS = 200               # ... for about the first 10 ms, then back off to cycle_time
IDLE_SLEEP_S = 0.02            # background sleep with nothing in flight (wakes at once on an async submit)
DEFER_BYTES = 64 << 10         # an async allreduce up to this size, submitted while the engine is idle, waits for
                               # its wait() to run it express (see submit)


class Engine:
    def __init__(self, topology, config):
        self.topo = topology
        self.config = config
        self.rank, self.size = topology.rank, topology.size
        self.ctrl = topology.world.Dup()
        self.watchdog = Watchdog(topology.local_peers, config.peer_check_s)
        self.host_ops = HOST_OPS
        self.executor = Executor(topology, config, self.watchdog)
        self.agreement = make_agreement(topology, self.ctrl, config, self.watchdog,
                                        shared=self.executor.transport("cpu").holds)
        # waits inside transports keep our control messages moving (see Watchdog.progress), and end when a peer
        # says its engine failed
        self.watchdog.progress = self.agreement.progress
        self.watchdog.failed_peer = self.agreement.failed_peer
        self.requests = {}              # name -> Request taken from the queue, not yet run (progress lock)
        self._running = ()              # the requests of the collective being executed
        self.submitted_names = set()    # names queued or in flight (state lock): duplicate detection
        self.queue = queue.SimpleQueue()
        self.wake = threading.Event()
        self._state_lock = threading.Lock()
        self._progress_lock = threading.Lock()
        self._drivers = 0               # callers currently driving: the background thread then stays out
        self._deferred = None           # an async request not handed to the engine yet (submit; state lock)
        self.failed = None              # a fatal RingtrainError: every later call raises it
        self.join_handle = None
        self.shutdown_requested = False
        self.finished = threading.Event()   # the engine stopped: shutdown agreed, or a fatal failure
        self.thread = threading.Thread(target=self._background, name="ringtrain-engine", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------------------------------------ caller side
    def submit(self, request):
        """Queue a request for the engine (an asynchronous collective: the background thread takes it up).

        A small async allreduce that the express path could run (express_eligible, one array up to DEFER_BYTES)
        submitted while nothing else is in flight is *deferred* instead: it is held here, and the background
        thread is not woken. A prompt wait() then runs it express on the caller's thread (one agreement cycle, no
        thread hand-off: what a synchronous call costs). Anything else hands it to the engine first, in submission
        order: another submission or call on this engine, a poll() of its handle, any engine pass (a peer's
        cycle included), or else the background thread's next look, within IDLE_SLEEP_S."""
        self._admit(request)
        if (express_eligible(request.meta) and len(request.arrays) == 1 and request.outs[0] is not None
                and request.arrays[0].nbytes <= DEFER_BYTES and not request.grouped):
            with self._state_lock:
                if (self._deferred is None and not self.requests and self.queue.empty()
                        and self.join_handle is None and not self._drivers):
                    self._deferred = request
                    request.handle._start = self._flush_deferred
                    return
        self._flush_deferred()
        self.queue.put(request)
        self.wake.set()

    def _flush_deferred(self):
        """Hand the deferred request (if any) to the engine's queue (see submit)."""
        if self._deferred is None:
            return
        with self._state_lock:
            request, self._deferred = self._deferred, None
        if request is not None:
            self.queue.put(request)
            self.wake.set()

    def _run_deferred(self, request):
        """wait() on the deferred request: run it express on this thread. True when it is done (its handle has its
        result); False when it went to the engine instead (the caller drives on as for any request)."""
        with self._state_lock:
            if self._deferred is not request:
                return False
            self._deferred = None
        outcome = self.express(request.name, request.meta, request.arrays[0], request.outs[0], request)
        if outcome is True:
            with self._state_lock:
                self.submitted_names.discard(request.name)
            request.handle._set_result(request.result())
            return True
        if outcome is None:                # express did not apply: an ordinary request after all
            self.queue.put(request)
        return False

    def run(self, request):
        """A synchronous collective: the caller drives the engine until `request` is done. When no one else is
        running a pass the request skips the queue (after what this thread queued before it, so the order of
        submission holds) and the caller's first pass starts from it."""
        self._admit(request)
        self._flush_deferred()
        self._drive_until(request.handle.done, None, first=request)

    def _admit(self, request):
        with self._state_lock:
            if self.failed is not None:
                raise self.failed
            if self.shutdown_requested:
                raise ShutdownError("ringtrain is shutting down; no new collectives")
            if request.name in self.submitted_names:
                raise ValueError(f"tensor name {request.name!r} is already in flight on rank {self.rank}; "
                                 "wait for it before reusing the name")
            self.submitted_names.add(request.name)

    def await_names_free(self, name):
        """Drive the engine until no collective named `name` (or `name`.<part>) is in flight on this rank: the
        recurring names of unnamed calls (names.slot_name) are reused only then."""
        if not self.submitted_names:
            return
        dotted = name + "."

        def free():
            with self._state_lock:
                return not any(n == name or n.startswith(dotted) for n in self.submitted_names)
        if not free():
            self._drive_until(free, None)
            if self.failed is not None:
                raise self.failed

    def join(self, handle):
        with self._state_lock:
            if self.failed is not None:
                raise self.failed
        self._flush_deferred()
        self.queue.put(("join", handle))
        self.wake.set()

    def shutdown(self, timeout):
        with self._state_lock:
            self.shutdown_requested = True
        self._flush_deferred()
        self.queue.put(("shutdown", None))
        self._drive_until(self.finished.is_set, time.monotonic() + timeout)
        if not self.finished.wait(0):
            log.warning("rank %d: shutdown() waited %.0fs for the other ranks to shut down; leaving anyway",
                        self.rank, timeout)
            return False
        self.thread.join(1.0)
        return True

    def transport_name(self, device="cpu"):
        return self.executor.transport_name(device)

    @property
    def transports(self):
        """device ('cpu' / 'cuda') -> the Transport this engine runs on (device transports appear on first use)."""
        return self.executor.transports

    @property
    def timeline(self):
        return self.executor.timeline

    @timeline.setter
    def timeline(self, timeline):
        """ringtrain.start_timeline() swaps in a new file at run time (never None: a stopped one is closed instead,
        and a closed Timeline ignores events, so whichever thread runs the engine may keep calling it)."""
        self.executor.timeline = timeline

    @property
    def stats(self):
        return self.executor.stats

    def drive(self, handle, deadline=None):
        """Progress the engine on the caller's thread until `handle` is done (or the deadline passes)."""
        deferred = self._deferred
        if deferred is not None and deferred.handle is handle and self._run_deferred(deferred):
            return
        self._drive_until(handle.done, deadline)

    def _drive_until(self, done, deadline, first=None):
        with self._state_lock:
            self._drivers += 1
        try:
            idle = 0
            lock = self._progress_lock
            # with a core per rank, this caller polls the answer it waits for instead of sleeping (Watchdog.yield_s)
            patient_s = self.watchdog.yield_s()
            patient_s = patient_s if patient_s > YIELD_S else 0.0
            idle_since = 0.0
            while not self.finished.is_set() and (first is not None or not done()):
                if deadline is not None and time.monotonic() > deadline:
                    return
                if not lock.acquire(blocking=False):
                    if first is not None:     # someone is mid-pass: the request takes the queue after all
                        self.queue.put(first)
                        first = None
                    # the background thread is running a pass (likely this very collective): give it the CPU, but
                    # no OS sleep -- that would add ~60 us after it finishes
                    os.sched_yield()
                    continue
                try:
                    if first is not None:
                        self._take_submissions()
                        self._register(first)
                        first = None
                    busy = self._guarded_pass()
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
                    self._idle_wait(idle, owed=True)
        finally:
            if first is not None:             # the engine stopped before the request could be registered
                with self._state_lock:
                    self.submitted_names.discard(first.name)
                first.handle._set_error(self.failed or ShutdownError(
                    f"rank {self.rank}: ringtrain was shut down before this collective completed"))
            with self._state_lock:
                self._drivers -= 1
            if self.requests or not self.queue.empty():
                self.wake.set()     # async work remains: the background thread takes over

    # ------------------------------------------------------------------------------------------------ background
    def _background(self):
        idle = 0
        while not self.finished.is_set():
            if self._drivers:
                self.wake.wait(IDLE_SLEEP_S)     # a caller is driving; it wakes us when it leaves
                self.wake.clear()
                continue
            with self._progress_lock:
                busy = self._guarded_pass()
            if busy:
                idle = 0
                continue
            idle += 1
            self._idle_wait(idle, owed=bool(self.requests or self.join_handle or self.agreement.owes()))

    def _idle_wait(self, idle, owed):
        """Nothing happened in the last pass. With work in flight an answer (or a peer's cycle) can come any moment:
        yield the CPU for a few passes, then poll every few tens of microseconds, backing off to cycle_time. With
        nothing in flight no answer is owed to us: sleep long, waking at once for a local async submission."""
        if owed:
            if idle < SPIN_PASSES:
                os.sched_yield()
                return
            delay = FAST_POLL_S if idle < FAST_POLLS else min(self.config.cycle_time_ms * 1e-3,
                                                               FAST_POLL_S * (idle - FAST_POLLS + 1))
        else:
            delay = IDLE_SLEEP_S
        if self.wake.wait(delay):
            self.wake.clear()

    # ------------------------------------------------------------------------------------------------ one pass
    def _guarded_pass(self):
        """A pass that turns any failure into errors on the waiting handles instead of a dead engine thread."""
        if self.finished.is_set():
            return False
        try:
            return self._pass()
        except BaseException as e:
            self._pass_failed(e)
        return False

    def _pass_failed(self, e):
        """Whatever a pass raised becomes the engine's failure (KeyboardInterrupt and SystemExit go on up)."""
        if isinstance(e, (_FailedIn, MPI.Exception)) and self.size > 1:
            # an MPI call can fail on a peer that was just killed before the watchdog's next look -- in a collective,
            # or in the agreement's own sends and probes (MPICH's ofi returns an error there): name the peer, not a
            # crash of this engine
            e = self.watchdog.peer_failure() or e
        if isinstance(e, RankFailureError):       # a peer died, failed, or this world was abandoned
            self._fail(e, fatal_peer=True)
            return
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            error = RingtrainError(f"ringtrain engine on rank {self.rank} stopped: interrupted inside a collective "
                                   f"({e!r})")
            announcement = str(error)
        elif isinstance(e, StallError):          # a peer never came: the message says who
            error = e
            announcement = f"ringtrain engine on rank {self.rank} stopped: {e}"
        else:  # a bug in ringtrain itself
            log.error("rank %d: ringtrain engine crashed", self.rank, exc_info=e)
            where, cause = (f" in {e}", e.__cause__) if isinstance(e, _FailedIn) else ("", e)
            error = RingtrainError(f"ringtrain engine on rank {self.rank} crashed{where}: {cause!r}")
            announcement = str(error)
        # peers may be waiting for this rank anywhere (a cycle, a barrier, an MPI request): tell them first, then
        # fail every local handle; the process ends soon, as one whose peer died does
        self.agreement.announce_failure(announcement)
        self._fail(error, stop=True, exit_soon=self.size > 1)
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise e

    # ------------------------------------------------------------------------------------------------ express
    def express(self, name, meta, array, out, request=None):
        """A synchronous allreduce of one host array (or the Segments of a grouped one), tried in one agreement
        cycle on the caller's thread with no request, handle or queue (agreement.CycleAgreement.express), then
        reduced from the cycle's slots or, too large for them, on the transport right here: True when `out` holds
        the result; a Handle
        when the cycle decided otherwise and the collective continues on the general path; None when it does not
        apply (something else in flight, a first sighting, a timeline being written) and nothing was done.
        `request`: the deferred async request this is (see submit), which becomes the ordinary request if need be."""
        self._flush_deferred()
        timeline = self.executor.timeline
        if (self.requests or self.join_handle is not None or (timeline is not None and not timeline.closed)
                or not express_eligible(meta)):
            return None
        lock = self._progress_lock
        if not lock.acquire(blocking=False):
            return None
        try:
            if (self.failed is not None or self.shutdown_requested or self.finished.is_set() or self.requests
                    or not self.queue.empty()):
                return None
            start = time.perf_counter()
            make_request = self._express_request if request is None else self._registered(request)
            outcome = self.agreement.express(name, meta, array, out, make_request)
            if outcome is None:
                return None
            if isinstance(outcome, Collective):     # agreed in its own cycle: this array alone
                self.executor.express(outcome, array, out)
                self.executor.stats.record("allreduce", array.nbytes, time.perf_counter() - start)
                return True
            handle = self.requests[name].handle
            self._execute(outcome)
            return handle
        except BaseException as e:
            self._pass_failed(e)
            request = self.requests.get(name)
            if request is not None:        # _fail() put the error on its handle
                return request.handle
            raise self.failed from e
        finally:
            lock.release()

    def _registered(self, request):
        """make_request for a deferred request: it becomes the engine's as it is (progress lock held)."""
        def make_request(name, meta, array, out):
            request.handle.times["queued"] = request.handle.times["submitted"]
            self.requests[name] = request
            return request
        return make_request

    def _express_request(self, name, meta, array, out):
        """The request an express allreduce becomes when its cycle did not finish it (progress lock held)."""
        with self._state_lock:
            self.submitted_names.add(name)
        if isinstance(array, Segments):    # a grouped allreduce: the general path packs its arrays
            request = Request(name, meta, tuple(array.given), tuple(out.given), Handle((name,), self.drive),
                              HOST_OPS, grouped=True)
        else:
            request = Request(name, meta, (array,), (out,), Handle((name,), self.drive), HOST_OPS)
        request.handle.times["queued"] = request.handle.times["submitted"]
        self.requests[name] = request
        return request

    def _pass(self):
        if self._deferred is not None:
            self._flush_deferred()
        busy = self._take_submissions()
        actions = self.agreement.poll()
        if actions:
            busy = True
            self._execute(actions)
        elif self.agreement.drives_mpi:
            self.agreement.progress()       # MPI moves what this rank handed it only inside MPI calls
        self.watchdog.check("the next collective")
        return busy

    def _take_submissions(self):
        queue_ = self.queue
        if queue_.empty():              # the usual case: cheaper than a get_nowait() raising Empty
            return False
        while True:
            try:
                item = queue_.get_nowait()
            except queue.Empty:
                return True
            if isinstance(item, tuple):
                kind, handle = item
                if kind == "join":
                    self.join_handle = handle
                self.agreement.add_control(kind)
                continue
            self._register(item)

    def _register(self, request):
        """Progress lock held: the request is this engine's now."""
        request.handle.times["queued"] = time.perf_counter()
        self.requests[request.name] = request
        self.agreement.add(request)

    # ------------------------------------------------------------------------------------------------ actions
    def _execute(self, actions):
        for action in actions:
            if isinstance(action, Collective):
                self._run_collective(action)
            elif isinstance(action, Shutdown):
                self._finish_shutdown()
                return
            elif isinstance(action, Warn):
                log.warning("rank %d: %s", self.rank, action.message)
            elif isinstance(action, Failed):
                held = [name for name in action.names if self._complete_error(
                    name, getattr(errors, action.error)(action.message))]
                if not held and action.error == "StallError":
                    # this rank holds none of the stalled collectives (it skipped them, or named them
                    # differently): no call of its own fails, so say it here -- its peers' calls did fail
                    log.error("rank %d: %s", self.rank, action.message)
            elif isinstance(action, JoinDone):
                if self.join_handle is not None:
                    self.join_handle._set_result(action.rank)
                    self.join_handle = None
            else:
                raise TypeError(f"unknown action {action!r}")

    def _run_collective(self, action):
        reqs = self._running = [self._take(name) for name in action.names]
        try:
            self.executor.run(action, reqs)
        except (RankFailureError, StallError):
            raise
        except Exception as e:
            # fatal to the engine (_fail() errors self._running too): the peers may be inside this very collective,
            # waiting for this rank, so no rank may simply go on to the next one
            raise _FailedIn(f"{action.kind} of {', '.join(map(repr, action.names[:4]))}") from e
        self._running = ()

    def _take(self, name):
        req = self.requests.pop(name, None)
        if req is not None:
            with self._state_lock:
                self.submitted_names.discard(name)
            t = req.handle.times
            t["started"] = time.perf_counter()
            timeline = self.executor.timeline
            if timeline is not None:
                timeline.span(name, "queued", t["submitted"], t["queued"])
                timeline.span(name, "negotiated", t["queued"], t["started"])
        return req

    def _complete_error(self, name, error):
        """Fail this rank's request `name`, if it holds one; True when it did."""
        req = self._take(name)
        if req is not None:
            req.handle._set_error(error)
        return req is not None

    # ------------------------------------------------------------------------------------------------ the end
    def _fail(self, error, fatal_peer=False, stop=False, exit_soon=False):
        """Fail every pending and future collective with `error`. fatal_peer: a peer failed or died; exit_soon:
        this engine failed with peers (told already). Both stop the engine and end the process after a grace
        period unless the job is elastic: MPI can no longer finish collectives with that peer (MPI_Finalize
        included), and an ignored error must not leave the job hanging."""
        exit_soon = exit_soon or fatal_peer
        if exit_soon:
            # first say so: once a caller sees its error it may exit, taking this (daemon) thread with it
            print(f"ringtrain rank {self.rank}: {error}" + ("" if self.config.elastic else "; exiting"),
                  file=sys.stderr, flush=True)
        with self._state_lock:
            if self.failed is None:
                self.failed = error
        for req in self._running:   # the collective that was running: already taken off self.requests
            if req is not None:
                req.handle._set_error(error)
        self._running = ()
        for name in list(self.requests):
            self._complete_error(name, error)
        if self.join_handle is not None:
            self.join_handle._set_error(error)
            self.join_handle = None
        self._flush_deferred()
        while True:   # requests still in the local queue
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                break
            handle = item[1] if isinstance(item, tuple) else item.handle
            if handle is not None:
                handle._set_error(error)
        if exit_soon or stop:
            self.finished.set()
            self.wake.set()
        if exit_soon and not self.config.elastic:      # an elastic job re-forms its world instead
            _arm_hard_exit(DEAD_PEER_EXIT_GRACE_S)

    def _finish_shutdown(self):
        error = ShutdownError(f"rank {self.rank}: ringtrain was shut down before this collective completed")
        for name in list(self.requests):
            self._complete_error(name, error)
        self.executor.finish(self.ctrl)
        self.finished.set()
        self.wake.set()

    def abort(self, reason):
        """From any thread: every wait of this engine ends with RankFailureError(reason), and so the engine fails
        on its own thread at its next pass (the background thread's, or a caller's)."""
        self.watchdog.abort_reason = reason
        self.wake.set()

    def abandon(self, error, timeout=5.0):
        """Leave this world without another MPI call on it (a peer died; an elastic job forms a new world): every
        wait ends with `error` on the engine's own thread (the watchdog's abort), so pending requests and the join
        handle get it, and the thread stops. Nothing is freed: freeing is collective, and a peer is gone."""
        with self._state_lock:
            self.shutdown_requested = True
        self.abort(str(error))
        if not self.finished.wait(timeout):     # no pass noticed in time: fail it from here
            locked = self._progress_lock.acquire(timeout=timeout)
            try:
                self._fail(error, stop=True)
            finally:
                if locked:
                    self._progress_lock.release()
        self.thread.join(timeout)

    def close(self):
        """Free MPI resources (collective); only after every rank's engine stopped cleanly."""
        self.executor.close()
        self.agreement.close()
        try:
            self.ctrl.Free()
        except Exception:
            pass


class _FailedIn(Exception):
    """Which collective a crash happened in (the crash itself is its __cause__)."""


_hard_exit_armed = False


def _arm_hard_exit(grace):
    global _hard_exit_armed
    if _hard_exit_armed:
        return
    _hard_exit_armed = True

    def _exit():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    timer = threading.Timer(grace, _exit)
    timer.daemon = True
    timer.start()
    # interpreter exit before the timer fires must not run MPI_Finalize against a dead peer either
    atexit.register(_exit)
