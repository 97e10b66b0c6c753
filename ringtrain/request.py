"""One rank's half of a named collective, as the caller thread hands it to the engine (no MPI import here, so
`import ringtrain` does not start MPI: that waits for init())."""


class Request:
    __slots__ = ("name", "meta", "array", "out", "handle", "ops", "ready_event")

    def __init__(self, name, meta, array, out, handle, ops, ready_event=None):
        self.name, self.meta, self.array, self.out = name, meta, array, out
        self.handle, self.ops, self.ready_event = handle, ops, ready_event
