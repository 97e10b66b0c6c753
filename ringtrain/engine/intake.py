"""What callers hand the engine: the queue its passes take requests from, the names in flight on this rank, and at
most one small asynchronous request held back for a prompt wait (see Engine.submit).

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
        self.deferred = None            # an async request not handed to the engine yet (lock)

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

    def hold(self, request, idle):
        """Lock held (the engine admits and holds in one critical section): hold `request` back instead of queueing
        it when nothing else is held or queued and idle() says the engine has nothing in flight. True when held."""
        if self.deferred is None and self.queue.empty() and idle():
            self.deferred = request
            return True
        return False

    def flush(self):
        """Hand the deferred request (if any) to the engine's queue."""
        if self.deferred is None:
            return
        with self.lock:
            request, self.deferred = self.deferred, None
        if request is not None:
            self.put(request)

    def claim(self, request):
        """The caller runs the deferred `request` itself: True when it was still held (and is no longer)."""
        with self.lock:
            if self.deferred is not request:
                return False
            self.deferred = None
        return True

    def take(self):
        """Every item queued so far, in order."""
        queue_ = self.queue
        while not queue_.empty():       # the usual case, empty: cheaper than a get_nowait() raising Empty
            try:
                yield queue_.get_nowait()
            except queue.Empty:
                return
