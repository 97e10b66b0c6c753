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
request then and there. A recurring small one (a plan the compiled call takes whole) is one C call while the engine
is idle: fast_state.py arms that call after an express call and takes its state back before anything else touches
the agreement. A small asynchronous allreduce submitted while nothing else is in flight is held back (held.py: its
HeldHandle alone, no request yet) so that a prompt wait() runs it the express way too; anything else hands it to
the engine. The background thread keeps asynchronous collectives moving while the caller computes, and
follows peers into agreement cycles while this rank is idle (not right after an express call: see _pass).

Every wait is a polled wait through the Watchdog, so a dead peer, a stall or an abort ends in an error naming
ranks and tensors, never a hang.

Beside this module: intake.py (the queue, the names in flight, the held-back request), driving.py (who runs the
passes and how they wait), control.py (the control messages), failure.py (what a failed pass becomes), held.py (the
held-back async allreduces), fast_state.py (the compiled call's state).
"""
import logging
import sys
import threading
import time
from functools import partial

from .. import errors
from .agreement import make_agreement
from .control import ControlChannel
from .driving import Driver
from .model import Collective, Failed, JoinDone, Shutdown, Warn, express_eligible
from ..errors import RankFailureError, ShutdownError, StallError
from .executor import Executor
from .express_memo import ExpressMemo
from .failure import DEAD_PEER_EXIT_GRACE_S, FailedIn, arm_hard_exit, pass_failure
from .fast_state import NO_FAST
from . import flight_recorder
from .flight_recorder import ERROR, FINISHED
from .fusion import HOST_OPS
from .handle import Handle
from .held import HeldCalls
from .intake import Intake
from .observer import Observer
from .request import Request
from ..transports.segments import Segments
from .watchdog import Watchdog

log = logging.getLogger("ringtrain")

CALLER_GRACE_S = 2e-4          # an engine thread this soon after an express call leaves a peer's cycle to the caller


class Engine:
    def __init__(self, topology, config):
        self.topo = topology
        self.config = config
        self.rank, self.size = topology.rank, topology.size
        self.ctrl = topology.world.Dup()
        self.watchdog = Watchdog(topology.local_peers, config.peer_check_s)
        self.host_ops = HOST_OPS
        self.executor = Executor(topology, config, self.watchdog)
        self.control = ControlChannel(self.ctrl, self.watchdog, config.drive_mpi_progress)
        self.agreement = make_agreement(topology, self.control, config, self.watchdog, self.executor.copy_into_slot,
                                        shared=self.executor.transport("cpu").holds)
        # waits inside transports keep our control messages moving (see Watchdog.progress), and end when a peer
        # says its engine failed
        self.watchdog.progress = self.control.progress
        self.watchdog.failed_peer = self.control.failed_peer
        # what the job is doing: the flight recorder, straggler scores, counts of failures (observer.py)
        self.observer = Observer(self.ctrl, topology, config, self.agreement, lambda: self.executor.timeline)
        self.recorder = self.observer.recorder
        self._express_stats = self.executor.stats.op("allreduce")    # the express path's counts (stats.py)
        self.requests = {}              # name -> Request taken from the queue, not yet run (progress lock)
        self.memo = ExpressMemo()       # recurring synchronous allreduces' plans (express_memo.py; the callers')
        self._running = ()              # the requests of the collective being executed
        self.wake = threading.Event()
        self.intake = Intake(self.rank, self.wake)     # the queue, the names in flight, a held-back allreduce
        self.held = HeldCalls(self)     # small async allreduces held back for a prompt wait (held.py)
        self.hold, self.run_held = self.held.hold, self.held.run
        self.intake.materialize = self.held.materialize
        self._state_lock = self.intake.lock
        self._progress_lock = threading.Lock()
        self.failed = None              # a fatal RingtrainError: every later call raises it
        self.closed = False             # failed, shutting down or finished: one word for the express path to read
        self.express_end = 0.0          # perf_counter time the last express call finished (see _pass)
        self.join_handle = None
        self.shutdown_requested = False
        self.finished = threading.Event()   # the engine stopped: shutdown agreed, or a fatal failure
        self.fast = self.agreement.fast or NO_FAST     # a planned allreduce whole in compiled code (fast_state.py)
        self.fast.attach(self)
        self.driver = Driver(self)      # who runs the passes, and how they wait in between
        self.thread = threading.Thread(target=self.driver.background, name="ringtrain-engine", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------------------------------------ caller side
    def submit(self, request):
        """Queue a request for the engine (an asynchronous collective: the background thread takes it up), after
        the held-back allreduce, if any (submission order)."""
        self._admit(request)
        self.intake.flush()
        self.intake.put(request)

    def run(self, request):
        """A synchronous collective: the caller drives the engine until `request` is done. When no one else is
        running a pass the request skips the queue (after what this thread queued before it, so the order of
        submission holds) and the caller's first pass starts from it."""
        self._admit(request)
        self.intake.flush()
        self.driver.until(request.handle.done, None, first=request)

    def _admit(self, request):
        """The request is this rank's in flight from now on (a name already in flight raises)."""
        self.fast.drain(blocking=False)     # (the compiled calls' flight-recorder entries come before its own)
        with self._state_lock:
            if self.failed is not None:
                raise self.failed
            if self.shutdown_requested:
                raise ShutdownError("ringtrain is shutting down; no new collectives")
            self.intake.admit(request.name)
            self.recorder.begin(request.name, request.meta, request.handle.times["submitted"], request.handle)

    def await_names_free(self, name):
        """Drive the engine until no collective named `name` (or `name`.<part>) is in flight on this rank: the
        recurring names of unnamed calls (names.slot_name) are reused only then."""
        in_flight = self.intake.in_flight
        if in_flight(name):
            self.driver.until(lambda: not in_flight(name), None)
            if self.failed is not None:
                raise self.failed

    def join(self, handle):
        self.fast.off()
        with self._state_lock:
            if self.failed is not None:
                raise self.failed
        self.intake.flush()
        self.intake.put(("join", handle))

    def shutdown(self, timeout):
        self.fast.off()
        with self._state_lock:
            self.shutdown_requested = self.closed = True
        self.intake.flush()
        self.intake.put(("shutdown", None))
        self.driver.until(self.finished.is_set, time.monotonic() + timeout)
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
        self.fast.off()
        self.executor.timeline = timeline

    @property
    def stats(self):
        """The communication stats, with the compiled calls' counts booked first (another thread's read)."""
        self.fast.drain()
        return self.executor.stats

    def drive(self, handle, deadline=None):
        """Progress the engine on the caller's thread until `handle` is done (or the deadline passes)."""
        self.driver.until(handle.done, deadline)

    # ------------------------------------------------------------------------------------------------ one pass
    def _guarded_pass(self, background=False):
        """A pass that turns any failure into errors on the waiting handles instead of a dead engine thread.
        background: the engine thread's (see _pass)."""
        if self.finished.is_set():
            return False
        try:
            began = time.perf_counter()      # (before the drain: its own time is not the caller's, see _pass)
            if self.fast.take(True):     # a caller's compiled call published a cycle it finishes itself (express)
                return False
            return self._pass(background, began)
        except BaseException as e:
            self._pass_failed(e)
        return False

    def _pass_failed(self, e):
        """Whatever a pass raised becomes the engine's failure (KeyboardInterrupt and SystemExit go on up)."""
        error, announcement = pass_failure(e, self.rank, self.size, self.watchdog)
        if isinstance(error, StallError) and self.recorder.capacity:
            error = StallError(f"{error}; {self.observer.pending_summary()}{self.observer.hint()}")
            announcement = f"ringtrain engine on rank {self.rank} stopped: {error}"
        if announcement is None:                  # a peer died, failed, or this world was abandoned
            self._fail(error, fatal_peer=True)
            return
        # peers may be waiting for this rank anywhere (a cycle, a barrier, an MPI request): tell them first, then
        # fail every local handle; the process ends soon, as one whose peer died does
        self.control.announce_failure(announcement)
        self._fail(error, stop=True, exit_soon=self.size > 1)
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise e

    # ------------------------------------------------------------------------------------------------ express
    def express(self, name, meta, array, out, held=None, plan=None, resumed=None):
        """A synchronous allreduce of one host array (or the Segments of a grouped one), tried in one agreement
        cycle on the caller's thread with no request, handle or queue (cycle_agreement.CycleAgreement.express), then
        reduced from the cycle's slots or, too large for them, on the transport right here: True when `out` holds
        the result; a Handle when the cycle decided otherwise and the collective continues on the general path; None
        when it does not apply (something else in flight, a first sighting, a timeline being written): nothing done.
        `held`: the held-back async allreduce this is (see hold), whose handle the request gets if need be.
        `plan`: the call's ExpressPlan (express_memo.py; made only for express-eligible calls)."""
        lock = self._progress_lock
        if resumed is None:
            if self.intake.deferred is not None:
                self.intake.flush()
            timeline = self.executor.timeline
            if (self.requests or self.join_handle is not None or (timeline is not None and not timeline.closed)
                    or (plan is None and not express_eligible(meta) and (self.size > 1 or meta.device != "cpu"))):
                return None
            if not lock.acquire(False):
                return None
        else:       # the compiled call (plan.fast) published its cycle: only this caller may finish it
            lock.acquire()
        entry = None
        try:
            if resumed is not None:
                self.fast.resolved()
                self.fast.take()
            # (closed: failed, shutting down or finished; the queue: a submission from another thread; an
            # unresolved cycle: another caller's compiled call published it, and that caller finishes it)
            elif self.fast.take() or self.closed or self.requests or not self.intake.queue.empty():
                return None
            start = time.perf_counter()
            entry = self.recorder.begin(name, meta, start if held is None else held.times["submitted"])
            outcome = self.agreement.express(name, meta, array, out, self._express_request if held is None
                                             else partial(self._express_request, held=held), plan, resumed)
            if outcome is True or outcome.__class__ is Collective:     # agreed in its own cycle: this array alone
                if outcome is not True:             # True: the native cycle reduced it already (native_cycle.py)
                    self.executor.express(outcome, array, out)
                end = self.express_end = time.perf_counter()
                self._express_stats.add(array.nbytes, end - start)    # (progress lock held: see CommStats.op)
                if entry is not None:
                    entry[FINISHED] = end
                if plan is not None and plan.fast is not None:    # its next call may be C's
                    self.fast.arm()
                return True
            if outcome is None:
                self.recorder.retract(entry)
                return None
            handle = self.requests[name].handle
            flight_recorder.attach(entry, handle)
            self._execute(outcome)
            return handle
        except BaseException as e:
            if entry is not None:
                entry[ERROR] = e
            self._pass_failed(e)
            request = self.requests.get(name)
            if request is not None:        # _fail() put the error on its handle
                return request.handle
            raise self.failed from e
        finally:
            lock.release()

    def _express_request(self, name, meta, array, out, held=None):
        """The request an express allreduce becomes when its cycle did not finish it (progress lock held). held: the
        HeldHandle it was (its name is in flight already): the request's handle."""
        if held is not None:
            request = Request(name, meta, (array,), (out,), held, HOST_OPS, plan=held.plan)
        elif isinstance(array, Segments):    # a grouped allreduce: the general path packs its arrays
            request = Request(name, meta, tuple(array.given), tuple(out.given), Handle((name,), self.drive),
                              HOST_OPS, grouped=True)
        else:
            request = Request(name, meta, (array,), (out,), Handle((name,), self.drive), HOST_OPS)
        if held is None:
            with self._state_lock:
                self.intake.names.add(name)
        request.handle.times["queued"] = request.handle.times["submitted"]
        self.requests[name] = request
        return request

    def _pass(self, background=False, began=None):
        """background: the engine thread's pass. With nothing in flight here, within CALLER_GRACE_S of this rank's
        last express call, it does not follow a peer into an agreement cycle: the caller is between two
        synchronous calls, and its next one publishes that cycle with its own id ready, keeping both ranks' calls
        on the express path (a follow-in's empty slot would turn the peer's call into a request). Later looks
        follow as usual (the stall and straggler machinery sees every cycle). began: when the pass began, before
        it drained the compiled calls (fast.take): the grace counts from there, as the drain of a thousand calls
        takes longer than the grace itself while the caller, between two calls, waits for the GIL it holds."""
        if self.intake.deferred is not None:
            self.intake.flush()
        busy = self._take_submissions()
        actions = self.agreement.poll(background and not busy and not self.requests and self.join_handle is None
                                      and (began or time.perf_counter()) - self.express_end < CALLER_GRACE_S)
        if actions:
            busy = True
            self._execute(actions)
        elif self.control.drives_mpi:
            self.control.progress()       # MPI moves what this rank handed it only inside MPI calls
        self.watchdog.check("the next collective")
        return busy

    def _take_submissions(self):
        intake = self.intake
        if intake.queue.empty():        # the usual case: no generator made
            return False
        busy = False
        for item in intake.take():
            busy = True
            if isinstance(item, tuple):
                kind, handle = item
                if kind == "join":
                    self.join_handle = handle
                self.agreement.add_control(kind)
                continue
            self._register(item)
        return busy

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
                message = self.observer.agreed_failure(action)
                held = [name for name in action.names if self._complete_error(
                    name, getattr(errors, action.error)(message))]
                if not held and action.error == "StallError":
                    # this rank holds none of the stalled collectives (it skipped them, or named them
                    # differently): no call of its own fails, so say it here -- its peers' calls did fail
                    log.error("rank %d: %s", self.rank, message)
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
            raise FailedIn(f"{action.kind} of {', '.join(map(repr, action.names[:4]))}") from e
        self._running = ()

    def _take(self, name):
        req = self.requests.pop(name, None)
        if req is not None:
            self.intake.release(name)
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
        self.fast.off()
        if self.failed is None and not isinstance(error, ShutdownError):
            self.observer.dump(error)
        if exit_soon:
            # first say so: once a caller sees its error it may exit, taking this (daemon) thread with it
            print(f"ringtrain rank {self.rank}: {error}" + ("" if self.config.elastic else "; exiting"),
                  file=sys.stderr, flush=True)
        with self._state_lock:
            if self.failed is None:
                self.failed = error
            self.closed = True
        for req in self._running:   # the collective that was running: already taken off self.requests
            if req is not None:
                req.handle._set_error(error)
        self._running = ()
        for name in list(self.requests):
            self._complete_error(name, error)
        if self.join_handle is not None:
            self.join_handle._set_error(error)
            self.join_handle = None
        self.intake.flush()
        for item in self.intake.take():   # requests still in the local queue
            handle = item[1] if isinstance(item, tuple) else item.handle
            if handle is not None:
                handle._set_error(error)
        if exit_soon or stop:
            self.finished.set()
            self.wake.set()
        if exit_soon and not self.config.elastic:      # an elastic job re-forms its world instead
            arm_hard_exit(DEAD_PEER_EXIT_GRACE_S)

    def _finish_shutdown(self):
        error = ShutdownError(f"rank {self.rank}: ringtrain was shut down before this collective completed")
        for name in list(self.requests):
            self._complete_error(name, error)
        self.executor.finish(self.ctrl)
        self.closed = True
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
        self.fast.off()
        with self._state_lock:
            self.shutdown_requested = self.closed = True
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
        self.fast.off()                 # (its plans' records hold the window's ctx: never armed past this)
        self.executor.close()
        self.agreement.close()
        try:
            self.ctrl.Free()
        except Exception:
            pass

