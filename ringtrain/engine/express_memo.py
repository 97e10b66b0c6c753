"""The express memo: what a recurring synchronous allreduce needs, made once and reused while it stays true.

A training loop (or a metric averaged every step) calls the same allreduce again and again: the same name -- or the
same position in the cycle of unnamed slots -- with arrays of the same dtype and shape, the same op and scales. Every
call would describe its array, build (or look up) its Meta, hash (name, Meta) to find its response-cache id, and
work out how the native cycle reduces it. The memo keeps the result of all that per (name, array signature): an
ExpressPlan. A call whose key hits goes straight to the engine's express cycle with its plan.

What a plan holds and when it stops being true:
- name and Meta: fixed by the key (the caller validated the arguments once, when it made the plan);
- the response-cache id and the native reduce: true only for the cache state they were read from. The plan keeps
  the cache's update count (CacheView.updates) it read them at; the agreement re-reads them when the count moved
  (an eviction, a first sighting of any name: every change to the cache is an update), so a plan never names an id
  that was evicted or reassigned;
- the process set and the world: a memo belongs to one engine, and every process set and every world (an elastic
  re-formation too) has its own engine, so a plan never outlives the communicator it was made for.

Bounded: past `capacity` plans the memo starts again from empty (a job that keeps inventing names pays the
general path's cost, as without the memo).
"""

CAPACITY = 4096


class ExpressPlan:
    """One recurring allreduce's express facts (see the module docstring). cid / how / generation are the
    agreement's to fill: generation -1 means not read yet."""
    __slots__ = ("name", "meta", "nbytes", "cid", "how", "native", "generation", "fast")

    def __init__(self, name, meta):
        self.name = name
        self.meta = meta
        self.nbytes = meta.nbytes
        self.cid = None             # the response-cache id of (name, meta) at `generation` (None: not cached)
        self.how = None             # the native cycle's reduce for it (native_cycle.reduce_how), at `generation`
        self.native = False         # the compiled cycle takes the call whole, at `generation` (the agreement's)
        self.generation = -1        # the cache's update count when cid and how were read
        self.fast = None            # the compiled module's record of the whole call (CycleAgreement._read_plan)


class ExpressMemo:
    """key -> ExpressPlan for one engine; the keys are the callers' (collectives.py, grouped.py)."""

    def __init__(self, capacity=CAPACITY):
        self.capacity = capacity
        self.plans = {}
        self.get = self.plans.get       # the hot path: one dict lookup

    def put(self, key, plan):
        if len(self.plans) >= self.capacity:
            self.plans.clear()
        self.plans[key] = plan
        return plan

    def clear(self):
        self.plans.clear()
