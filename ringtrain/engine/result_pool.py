"""Result arrays of allocating collectives (`y = rt.allreduce(x)`), reused once their caller has dropped them.

Two kinds of block:

- Shared blocks (SHARED_MIN_BYTES up to the transport's capacity), carved once from the host transport's shared
  window (`attach(transport)`; shm's shared_array()): an allreduce into one reads nothing back out -- peers push their
  reduced blocks straight into it -- so `y = allreduce(x)` costs less than `allreduce_(x)` on ordinary memory, where
  an out-of-place result in ordinary memory costs ~1.3x the in-place call at 16 MB (every line of the new result is
  read in before it is written). The window's pool is never given back, so at most SHARED_BUDGET bytes are taken
  from it (what is left serves empty_shared() buffers), and a free block serves any result that fits in it.
- Results from SHARED_MIN_BYTES up that no shared block serves are ALIGNMENT-aligned (TF and XLA adopt them without
  a copy).
- Private blocks (MIN_BYTES and up): glibc's malloc keeps freed blocks below 32 MB (its mmap threshold adapts up to
  there), so those results cost no page faults already. Above it malloc maps and unmaps every time: the pool keeps
  KEEP blocks, which spares 64 MB results 16,384 fresh pages (+16-21 ms per call).

A block is handed out again only when nothing but the pool refers to it. Its reference count says so: a user
variable, a view or slice of the result (numpy points a view's base at the block), a torch tensor made by
from_numpy, a request still in flight (it holds its outputs), a transport remembering the buffer it reduced last --
each holds a reference. Nothing can gain a reference to an unreferenced block except through the pool, and the pool
makes the result's view before it lets go of its lock, so the check cannot race with another thread.
"""
import math
import operator
import sys
import threading

import numpy as np

MIN_BYTES = 32 << 20
KEEP = 2
SHARED_MIN_BYTES = 256 << 10
SHARED_BUDGET = 64 << 20
ALIGNMENT = 64              # every result from SHARED_MIN_BYTES up starts on a cache line (the window's blocks too)


class ResultPool:
    def __init__(self, min_bytes=MIN_BYTES, keep=KEEP, shared_min_bytes=SHARED_MIN_BYTES,
                 shared_budget=SHARED_BUDGET):
        self._min_bytes = min_bytes
        self._keep = keep
        self._blocks = []              # uint8 arrays owning their memory
        self._lock = threading.Lock()
        self._shared_min_bytes = shared_min_bytes
        self._shared_budget = shared_budget
        self._transport = None         # the host transport whose shared window the shared blocks lie in
        self._shared_max = 0
        self._shared_left = 0
        self._shared = []              # uint8 arrays over the window, each the base of every view made of it

    def attach(self, transport):
        """Take shared blocks from `transport.shared_array` from now on (the world engine's host transport)."""
        with self._lock:
            self._transport = transport
            self._shared_max = int(getattr(transport, "capacity", 0))
            self._shared_left = self._shared_budget
            self._shared = []

    def detach(self, transport):
        """Stop using `transport`'s window (it is closing). Blocks already handed out stay valid: a window that
        handed out shared arrays stays mapped until exit."""
        with self._lock:
            if self._transport is transport:
                self._transport, self._shared, self._shared_left = None, [], 0

    def empty(self, shape, dtype, shared=True):
        """A result array; shared=False: never a shared block (a grouped call's outputs: the transport reads and
        writes a group's arrays where they lie only when none of them is in its window)."""
        dtype = np.dtype(dtype)
        # math.prod, not np.prod: this runs on every allocating collective, and np.prod costs ~3.5 us
        nbytes = (math.prod(shape) if hasattr(shape, "__len__") else operator.index(shape)) * dtype.itemsize
        if shared and self._shared_min_bytes <= nbytes <= self._shared_max:
            with self._lock:
                block = self._take_shared(nbytes)
                if block is not None:
                    return block[:nbytes].view(dtype).reshape(shape)
        if nbytes >= self._min_bytes:
            with self._lock:
                return self._take(nbytes).view(dtype).reshape(shape)
        if nbytes >= self._shared_min_bytes:
            return _aligned(np.empty(nbytes + ALIGNMENT, dtype=np.uint8), nbytes).view(dtype).reshape(shape)
        return np.empty(shape, dtype=dtype)

    def _take_shared(self, nbytes):
        """The smallest unused shared block of at least nbytes, a new one while the budget lasts, or None."""
        free = [b for b in _unreferenced(self._shared) if b is not None and b.nbytes >= nbytes]
        if free:
            return min(free, key=lambda b: b.nbytes)
        if self._transport is None or nbytes > self._shared_left:
            return None
        raw = self._transport.shared_array(nbytes)
        if raw is None:
            self._shared_left = 0
            return None
        # a fresh ndarray over a memoryview: views of it point their base here (not at the whole window, as views
        # of `raw` would), so its reference count tells whether a result made of it is alive
        block = np.frombuffer(memoryview(raw), dtype=np.uint8)
        self._shared_left -= nbytes
        self._shared.append(block)
        return block

    def _take(self, nbytes):
        """ALIGNMENT-aligned private memory of exactly nbytes: in a dropped block of that size, else in a new one
        (kept while fewer than `keep` are, or in place of an unused one of another size). A block is the uint8
        array that owns its memory, so views of it point their base at it."""
        free = [i for i, b in enumerate(_unreferenced(self._blocks)) if b is not None]
        for i in free:
            if self._blocks[i].nbytes == nbytes + ALIGNMENT:
                return _aligned(self._blocks[i], nbytes)
        block = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
        if len(self._blocks) < self._keep:
            self._blocks.append(block)
        elif free:                     # an unused block of another size makes room
            self._blocks[free[0]] = block
        return _aligned(block, nbytes)


def _aligned(raw, nbytes):
    """nbytes of raw (ALIGNMENT more than that) starting on an ALIGNMENT boundary (np.empty's is 16-byte aligned):
    TF and XLA adopt such a result without a copy."""
    start = -raw.__array_interface__["data"][0] % ALIGNMENT
    return raw[start:start + nbytes]


def _counts(blocks):
    return [sys.getrefcount(b) for b in blocks]


_ALONE = _counts([np.empty(1, np.uint8)])[0]     # a block only its list refers to, counted the same way


def _unreferenced(blocks):
    """blocks, each replaced by None where anything but the list refers to it."""
    return [b if n <= _ALONE else None for b, n in zip(blocks, _counts(blocks))]
