"""Handle: what an async collective returns.

wait() does not sleep while someone else works: when the engine is free, the waiting caller drives it itself (see
Engine.drive), so a synchronous collective costs no thread hand-off and no OS wake-up. When the engine thread is
busy with this rank's other collectives, wait() blocks in short slices so Ctrl-C still reaches the caller.
"""
import threading
import time


class Handle:
    __slots__ = ("names", "_event", "_result", "_error", "_done_event", "_driver", "times")

    def __init__(self, names, driver=None):
        self.names = names                  # tensor names this handle covers
        self._event = threading.Event()
        self._result = None
        self._error = None
        self._done_event = None             # CUDA event for device results, synchronised in wait()
        self._driver = driver               # engine.drive(handle, deadline): progress the engine until done
        self.times = {"submitted": time.perf_counter()}

    # called by whoever runs the engine
    def _set_result(self, result, done_event=None):
        self._result, self._done_event = result, done_event
        self.times["finished"] = time.perf_counter()
        self._event.set()

    def _set_error(self, error):
        if self._event.is_set():
            return
        self._error = error
        self.times["finished"] = time.perf_counter()
        self._event.set()

    def done(self):
        return self._event.is_set()

    def poll(self):
        """True once the result (or an error) is available; never blocks."""
        if not self._event.is_set():
            return False
        return self._done_event is None or self._done_event.query()

    def wait(self, timeout=None):
        """Block until done and return the result, raising the collective's error on this rank if it failed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._event.is_set() and self._driver is not None:
            self._driver(self, deadline)
        while not self._event.wait(0.1):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"collective on {list(self.names[:3])} not finished after {timeout}s")
        if self._error is not None:
            raise self._error
        if self._done_event is not None:
            self._done_event.synchronize()
            self._done_event = None
        return self._result

    def __repr__(self):
        state = "done" if self._event.is_set() else "pending"
        return f"<Handle {self.names[0] if len(self.names) == 1 else list(self.names[:2])} {state}>"
