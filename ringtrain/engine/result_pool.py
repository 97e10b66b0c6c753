"""Large result arrays, reused once their caller has dropped them: `y = rt.allreduce(x)` on 64 MB then does not pay
for 16,384 fresh pages (faulted in and zeroed by the kernel: +16-21 ms per call on the dev machine, half the
collective's own time).

Below MIN_BYTES nothing is pooled: glibc's malloc keeps freed blocks and hands them out again (its mmap threshold
adapts up to 32 MB), so those results cost no page faults already. Above it malloc maps and unmaps every time.

A block is handed out again only when nothing but the pool refers to it. Its reference count says so: a user
variable, a view or slice of the result (numpy points a view's base at the block), a torch tensor made by
from_numpy, a request still in flight (it holds its outputs) -- each holds a reference. Nothing can gain a reference
to an unreferenced block except through the pool, so the check cannot race with another thread. The price is up to
KEEP blocks kept mapped after their last use, as every caching allocator keeps some.
"""
import math
import operator
import sys
import threading

import numpy as np

MIN_BYTES = 32 << 20
KEEP = 2


class ResultPool:
    def __init__(self, min_bytes=MIN_BYTES, keep=KEEP):
        self._min_bytes = min_bytes
        self._keep = keep
        self._blocks = []              # uint8 arrays owning their memory
        self._lock = threading.Lock()

    def empty(self, shape, dtype):
        dtype = np.dtype(dtype)
        # math.prod, not np.prod: this runs on every allocating collective, and np.prod costs ~3.5 us
        nbytes = (math.prod(shape) if hasattr(shape, "__len__") else operator.index(shape)) * dtype.itemsize
        if nbytes < self._min_bytes:
            return np.empty(shape, dtype=dtype)
        with self._lock:
            block = self._take(nbytes)
        return block.view(dtype).reshape(shape)

    def _take(self, nbytes):
        free = [i for i in range(len(self._blocks)) if self._unused(i)]
        for i in free:
            if self._blocks[i].nbytes == nbytes:
                return self._blocks[i]
        block = np.empty(nbytes, dtype=np.uint8)
        if len(self._blocks) < self._keep:
            self._blocks.append(block)
        elif free:                     # an unused block of another size makes room
            self._blocks[free[0]] = block
        return block

    def _unused(self, i):
        # two references: the pool's list and getrefcount's own argument
        return sys.getrefcount(self._blocks[i]) == 2
