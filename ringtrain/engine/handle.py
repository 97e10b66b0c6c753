"""Handle: what an async collective returns.

wait() does not sleep while someone else works: when the engine is free, the waiting caller drives it itself (see
Engine.drive), so a synchronous collective costs no thread hand-off and no OS wake-up. When the engine thread is
busy with this rank's other collectives, wait() blocks in short slices so Ctrl-C still reaches the caller.
"""
import threading
import time
from time import perf_counter as perf

from .flight_recorder import finish_record

DEFER_BYTES = 64 << 10         # an async allreduce up to this size, submitted while the engine is idle, is held
                               # back for its wait() to run it express (Engine.hold, HeldHandle)


class Handle:
    """The result of an asynchronous collective (`allreduce_async` and friends). `wait(timeout=None)` blocks until it
    finishes and returns its result, or raises its error; `poll()` says whether it has finished without blocking.
    `times` holds time.perf_counter() stamps: 'submitted', 'started' (its bucket entered the ring), 'finished'."""
    __slots__ = ("names", "_done", "_event", "_result", "_error", "_done_event", "_driver", "_start", "times",
                 "record")

    def __init__(self, names, driver=None):
        self.names = names                  # tensor names this handle covers
        self._done = False
        self._event = None                  # created only when a thread has to block (most waits drive instead)
        self._result = None
        self._error = None
        self._done_event = None             # CUDA event for device results, synchronised in wait()
        self._driver = driver               # engine.drive(handle, deadline): progress the engine until done
        self._start = None                  # set while the engine holds it back for a prompt wait (Engine.submit)
        self.times = {"submitted": time.perf_counter()}
        self.record = None                  # its flight-recorder entry, told how it ended (flight_recorder.attach)

    # called by whoever runs the engine
    def _set_result(self, result, done_event=None):
        self._result, self._done_event = result, done_event
        self._finish()

    def _set_error(self, error):
        if self._done:
            return
        self._error = error
        self._finish()

    def _finish(self):
        self.times["finished"] = time.perf_counter()
        if self.record is not None:
            finish_record(self.record, self.times["finished"], self._error)
            self.record = None
        # order matters (and the GIL keeps it): a waiter creates the event, then re-reads _done; we set _done,
        # then read the event -- so either the waiter sees _done or we see (and set) its event
        self._done = True
        event = self._event
        if event is not None:
            event.set()

    def done(self):
        return self._done

    def poll(self):
        """True once the result (or an error) is available; never blocks."""
        if not self._done:
            if self._start is not None:     # polled, not waited for: it starts now
                self._start()
            return False
        return self._done_event is None or self._done_event.query()

    def wait(self, timeout=None):
        """Block until done and return the result, raising the collective's error on this rank if it failed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._done and self._driver is not None:
            self._driver(self, deadline)
        if not self._done:
            if self._event is None:
                self._event = threading.Event()
            while not self._done and not self._event.wait(0.1):
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"collective on {list(self.names[:3])} not finished after {timeout}s")
        if self._error is not None:
            raise self._error
        if self._done_event is not None:
            self._done_event.synchronize()
            self._done_event = None
        return self._result

    def __repr__(self):
        state = "done" if self._done else "pending"
        return f"<Handle {self.names[0] if len(self.names) == 1 else list(self.names[:2])} {state}>"


class HeldHandle(Handle):
    """The handle of a small asynchronous allreduce that the engine holds back for a prompt wait (Engine.hold):
    no request exists yet, only this record of the call (its ExpressPlan, array and out). wait() first lets the
    engine run it express on the caller's thread (Engine.run_held); if it was handed to the engine meanwhile (another
    call, a poll, an engine pass), it is an ordinary request's handle by then, and wait() drives as for any."""
    __slots__ = ("plan", "array", "out", "_run")

    def __init__(self, name, plan, array, out, engine):
        # Handle.__init__'s fields, set here (one frame less on a path that costs microseconds)
        self.names, self._done, self._event, self._result, self._error = (name,), False, None, None, None
        self._done_event, self._driver, self.times, self.record = None, engine.drive, {"submitted": perf()}, None
        self._start = engine.intake.flush        # polled, not waited for: it starts now
        self.plan, self.array, self.out = plan, array, out
        self._run = engine.run_held

    def wait(self, timeout=None):
        if not self._done:
            self._run(self)
            if not self._done:              # an ordinary request now: drive or block as any handle does
                return Handle.wait(self, timeout)
        error = self._error
        if error is not None:
            raise error
        return self._result                 # (a host array: no device event to wait for)
