"""Handle: what an async collective returns. wait() blocks in short slices so Ctrl-C still reaches the caller."""
import threading
import time


class Handle:
    __slots__ = ("names", "_event", "_result", "_error", "_done_event", "times")

    def __init__(self, names):
        self.names = names                  # tensor names this handle covers
        self._event = threading.Event()
        self._result = None
        self._error = None
        self._done_event = None             # CUDA event for device results, synchronised in wait()
        self.times = {"submitted": time.perf_counter()}

    # called by the engine thread
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

    def poll(self):
        """True once the result (or an error) is available; never blocks."""
        if not self._event.is_set():
            return False
        return self._done_event is None or self._done_event.query()

    def wait(self, timeout=None):
        """Block until done and return the result, raising the collective's error on this rank if it failed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._event.wait(0.1):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"collective on {self.names[:3]} not finished after {timeout}s")
        if self._error is not None:
            raise self._error
        if self._done_event is not None:
            self._done_event.synchronize()
            self._done_event = None
        return self._result

    def __repr__(self):
        state = "done" if self._event.is_set() else "pending"
        return f"<Handle {self.names[0] if len(self.names) == 1 else self.names[:2]} {state}>"


class GroupHandle(Handle):
    """Completes when all of its parts complete; wait() returns the list of their results."""
    __slots__ = ("parts",)

    def __init__(self, parts):
        super().__init__([n for p in parts for n in p.names])
        self.parts = parts

    def poll(self):
        return all(p.poll() for p in self.parts)

    def wait(self, timeout=None):
        results = [p.wait(timeout) for p in self.parts]
        self.times.update(started=min((p.times.get("started", 0.0) for p in self.parts), default=0.0),
                          finished=max((p.times.get("finished", 0.0) for p in self.parts), default=0.0))
        return results
