"""What callers hand the engine: the queue its passes take requests from, the names in flight on this rank, and at
most one small asynchronous allreduce held back for a prompt wait (a HeldHandle; see Engine.hold).

The lock here is the engine's state lock: it also guards what the engine keeps beside it (its failure, shutdown
and the count of callers driving), so that admitting a request and deciding to hold one back see one state.
"""
import queue
import threading


class Intake:
    """The hand-over between the threads that submit collectives and whichever thread runs the engine's passes."""

    def __init__(self, rank, wake):
        self.rank = rank
        self.wake = wake                # the engine thread's doorbell
        self.queue = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.names = set()              # names queued or in flight (lock): duplicate detection
        self.deferred = None            # a HeldHandle: an async allreduce not handed to the engine yet (lock)
        self.materialize = None         # HeldHandle -> its Request, when it is handed to the engine (the engine's)

    def put(self, item):
        """Queue a request (or a ("join" | "shutdown", handle) control item) and wake the engine thread."""
        self.queue.put(item)
        self.wake.set()

    def admit(self, name):
        """Lock held: `name` is in flight on this rank from now on; a name already in flight is refused."""
        if name in self.names:
            raise ValueError(f"tensor name {name!r} is already in flight on rank {self.rank}; "
                             "wait for it before reusing the name")
        self.names.add(name)

    def release(self, name):
        with self.lock:
            self.names.discard(name)

    def in_flight(self, name):
        """Is a collective named `name` (or `name`.<part>) queued or in flight on this rank?"""
        if not self.names:
            return False
        dotted = name + "."
        with self.lock:
            return any(n == name or n.startswith(dotted) for n in self.names)

    def flush(self):
        """Hand the held-back allreduce (if any) to the engine's queue, as an ordinary request."""
        if self.deferred is None:
            return
        with self.lock:
            request, self.deferred = self.deferred, None
            if request is not None:
                request = self.materialize(request)
        if request is not None:
            self.put(request)

    def take(self):
        """Every item queued so far, in order."""
        queue_ = self.queue
        while not queue_.empty():       # the usual case, empty: cheaper than a get_nowait() raising Empty
            try:
                yield queue_.get_nowait()
            except queue.Empty:
                return
