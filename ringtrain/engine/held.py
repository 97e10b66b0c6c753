"""A small asynchronous allreduce submitted while its engine is idle is *held back* (hold()): no request is made and
the background thread is not woken, so that a prompt wait() runs it the express way on the waiting thread (run()),
as a synchronous call runs. Anything else hands it to the engine as an ordinary request (materialize(), through the
intake), in submission order."""
from ..errors import ShutdownError
from .fusion import HOST_OPS
from .request import Request


class HeldCalls:
    """One engine's held-back async allreduces: hold, run at the wait, or hand to the engine."""

    def __init__(self, engine):
        self._engine = engine

    def hold(self, held):
        """A small async allreduce with an ExpressPlan (up to handle.DEFER_BYTES), submitted while nothing else is in
        flight here, is *held back*: no request is made and the background thread is not woken; its HeldHandle records
        the call. A prompt wait() then runs it express on the caller's thread (run(): one agreement cycle, no thread
        hand-off, what a synchronous call costs). Anything else hands it to the engine first as an ordinary request,
        in submission order: another submission or call on this engine, a poll() of its handle, any engine pass (a
        peer's cycle included), or else the background thread's next look, within driving.IDLE_SLEEP_S.
        True when held (its name is in flight from now on; a name already in flight raises); False when the engine
        is not idle and the caller submits it as a request."""
        engine = self._engine
        intake = engine.intake
        if engine.fast.hold():          # armed: the engine is idle (nothing held, queued or in flight; no join)
            name = held.names[0]
            with engine._state_lock:
                if engine.failed is None and not engine.shutdown_requested and name not in intake.names:
                    intake.names.add(name)
                    intake.deferred = held
                    return True
        engine.fast.off()
        with engine._state_lock:       # (the intake's lock: state, admission and the hold in one critical section)
            if engine.failed is not None:
                raise engine.failed
            if engine.shutdown_requested:
                raise ShutdownError("ringtrain is shutting down; no new collectives")
            # nothing held or queued, nothing in flight here and no caller driving
            if (intake.deferred is not None or engine.requests or engine.join_handle is not None
                    or engine.driver.count or not intake.queue.empty()):
                return False
            name = held.names[0]
            if name in intake.names:
                intake.admit(name)      # (raises)
            intake.names.add(name)
            intake.deferred = held
            return True

    def run(self, held):
        """wait() on a HeldHandle: run it express on this thread when it is still held. Its handle has its result
        when that finished it; otherwise it is an ordinary request now (or was already) and the caller drives on."""
        engine = self._engine
        intake = engine.intake
        with intake.lock:
            if intake.deferred is not held:     # handed to the engine already
                return
            intake.deferred = None
        name = held.names[0]
        plan = held.plan
        fast = plan.fast
        outcome = None if fast is None else fast[0](fast, held.array, held.out, held)   # armed by hold(): one C call
        if outcome is not True:     # (0 / 2: the C call published its cycle; Engine.express goes on from there)
            outcome = engine.express(name, plan.meta, held.array, held.out, held, plan, outcome)
        if outcome is True:
            intake.names.discard(name)      # (one atomic set operation: no lock needed to drop our own name)
            held._result = held.out
            held._finish()
        elif outcome is None:               # express did not apply: an ordinary request after all
            intake.put(self.materialize(held))

    def materialize(self, held):
        """The Request of a held-back allreduce handed to the engine (its name is in flight already), with its
        flight-recorder entry."""
        plan = held.plan
        request = Request(held.names[0], plan.meta, (held.array,), (held.out,), held, HOST_OPS, plan=plan)
        self._engine.recorder.begin(request.name, plan.meta, held.times["submitted"], held)
        return request
