"""One rank's half of a named collective, as the caller hands it to the engine (no MPI import here, so
`import ringtrain` does not start MPI: that waits for init()).

A grouped allreduce (an optimizer bucket) is ONE request over many arrays: one name, one metadata record, one cache
id, one handle. Its arrays are packed back to back, so the per-step cost does not grow with a per-tensor protocol.
"""


class Request:
    __slots__ = ("name", "meta", "arrays", "outs", "handle", "ops", "ready_event", "grouped", "plan")

    def __init__(self, name, meta, arrays, outs, handle, ops, ready_event=None, grouped=False, plan=None):
        self.name, self.meta, self.arrays, self.outs = name, meta, arrays, outs
        self.handle, self.ops, self.ready_event, self.grouped = handle, ops, ready_event, grouped
        self.plan = plan            # its ExpressPlan (express_memo.py) when the caller has one

    @property
    def array(self):
        return self.arrays[0]

    @property
    def out(self):
        return self.outs[0]

    def result(self, value=None):
        """What handle.wait() returns: the outs (list for grouped), or an explicit value (allgather, alltoall)."""
        if value is not None:
            return value
        return list(self.outs) if self.grouped else self.outs[0]
