"""Handles over several collectives: a grouped allreduce of mixed dtypes, grouped allgather / reducescatter."""
from ..engine.handle import Handle


class MixedGroupHandle(Handle):
    """A grouped allreduce over several dtypes: one request per dtype; wait() returns results in input order."""
    __slots__ = ("count", "parts")

    def __init__(self, count, parts):
        super().__init__(tuple(n for _, h in parts for n in h.names))
        self.count, self.parts = count, parts

    def done(self):
        return all(h.done() for _, h in self.parts)

    def poll(self):
        return all(h.poll() for _, h in self.parts)

    def wait(self, timeout=None):
        results = [None] * self.count
        for positions, handle in self.parts:
            for i, r in zip(positions, handle.wait(timeout)):
                results[i] = r
        self.times.update(started=min(h.times.get("started", 0.0) for _, h in self.parts),
                          finished=max(h.times.get("finished", 0.0) for _, h in self.parts))
        return results


class ListHandle(Handle):
    """One handle over several collectives (grouped allgather / reducescatter); wait() returns their results."""
    __slots__ = ("parts",)

    def __init__(self, parts):
        super().__init__(tuple(n for h in parts for n in h.names))
        self.parts = parts

    def done(self):
        return all(h.done() for h in self.parts)

    def poll(self):
        return all(h.poll() for h in self.parts)

    def wait(self, timeout=None):
        results = [h.wait(timeout) for h in self.parts]
        self.times.update(started=min(h.times.get("started", 0.0) for h in self.parts),
                          finished=max(h.times.get("finished", 0.0) for h in self.parts))
        return results
