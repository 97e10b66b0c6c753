"""Result arrays of allocating collectives (`y = rt.allreduce(x)`), reused once their caller has dropped them.

- Results from ALIGNED_BYTES up start on an ALIGNMENT boundary (np.empty's are 16-byte aligned): TF and XLA adopt
  such a result without a copy.
- Large results (MIN_BYTES and up) come from KEEP kept blocks: glibc's malloc keeps freed blocks below 32 MB (its
  mmap threshold adapts up to there), so smaller results cost no page faults already (measured: 0 minor faults per
  call for 16 MB out-of-place allreduces). Above it malloc maps and unmaps every time: the kept blocks spare 64 MB
  results 16,384 fresh pages (+16-21 ms per call).

Results are deliberately ordinary memory, not blocks of the shm transport's shared window: an allreduce into a
window buffer skips the copy-out, but it runs over the whole buffer in one pass instead of the cache-sized chunks
private data takes, and on a quiet machine that lost (2 ranks, best of 7 interleaved rounds: 1 MB 1.35 ms against
1.04 ms private, 16 MB 4.4 against 4.1).

A block is handed out again only when nothing but the pool refers to it. Its reference count says so: a user
variable, a view or slice of the result (numpy points a view's base at the block), a torch tensor made by
from_numpy, a request still in flight (it holds its outputs) -- each holds a reference. Nothing can gain a reference
to an unreferenced block except through the pool, and the pool makes the result's view before it lets go of its
lock, so the check cannot race with another thread.
"""
import math
import operator
import sys
import threading

import numpy as np

from ..aligned import aligned_view

MIN_BYTES = 32 << 20
KEEP = 2
ALIGNED_BYTES = 256 << 10
ALIGNMENT = 64


class ResultPool:
    def __init__(self, min_bytes=MIN_BYTES, keep=KEEP, aligned_bytes=ALIGNED_BYTES):
        self._min_bytes = min_bytes
        self._keep = keep
        self._aligned_bytes = aligned_bytes
        self.plain_below = min(min_bytes, aligned_bytes)    # smaller results are plain np.empty arrays (empty())
        self._blocks = []              # uint8 arrays owning their memory
        self._lock = threading.Lock()

    def empty(self, shape, dtype):
        dtype = np.dtype(dtype)
        # math.prod, not np.prod: this runs on every allocating collective, and np.prod costs ~3.5 us
        nbytes = (math.prod(shape) if hasattr(shape, "__len__") else operator.index(shape)) * dtype.itemsize
        if nbytes >= self._min_bytes:
            with self._lock:
                return self._take(nbytes).view(dtype).reshape(shape)
        if nbytes >= self._aligned_bytes:
            raw = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
            return aligned_view(raw, nbytes, ALIGNMENT).view(dtype).reshape(shape)
        return np.empty(shape, dtype=dtype)

    def _take(self, nbytes):
        """ALIGNMENT-aligned memory of exactly nbytes: in a dropped block of that size, else in a new one (kept
        while fewer than `keep` are, or in place of an unused one of another size). A block is the uint8 array that
        owns its memory, so views of it point their base at it."""
        free = [i for i, b in enumerate(_unreferenced(self._blocks)) if b is not None]
        for i in free:
            if self._blocks[i].nbytes == nbytes + ALIGNMENT:
                return aligned_view(self._blocks[i], nbytes, ALIGNMENT)
        block = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
        if len(self._blocks) < self._keep:
            self._blocks.append(block)
        elif free:                     # an unused block of another size makes room
            self._blocks[free[0]] = block
        return aligned_view(block, nbytes, ALIGNMENT)


def _counts(blocks):
    return [sys.getrefcount(b) for b in blocks]


_ALONE = _counts([np.empty(1, np.uint8)])[0]     # a block only its list refers to, counted the same way


def _unreferenced(blocks):
    """blocks, each replaced by None where anything but the list refers to it."""
    return [b if n <= _ALONE else None for b, n in zip(blocks, _counts(blocks))]
