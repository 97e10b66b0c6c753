"""Host arrays whose data starts on a chosen boundary. TensorFlow and XLA adopt a numpy buffer without a copy only
when it is 64-byte aligned (np.empty gives 16), so results meant for them are allocated this way."""
import math
import threading

import numpy as np


def aligned_view(raw, nbytes, alignment):
    """nbytes of the uint8 array `raw` (allocated `alignment` bytes longer) starting on an `alignment` boundary."""
    start = -raw.__array_interface__["data"][0] % alignment
    return raw[start:start + nbytes]


def aligned_empty(shape, dtype, alignment):
    """An uninitialised C-contiguous array of `shape` whose data starts on an `alignment` boundary."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize      # math.prod and __array_interface__: ~10 us less than np.prod
    raw = np.empty(nbytes + alignment, np.uint8)     # and .ctypes on every eager call
    return aligned_view(raw, nbytes, alignment).view(dtype).reshape(shape)


class Slab:
    """Small aligned arrays cut one after another from shared blocks: `empty` costs a slice instead of an allocation
    and the alignment arithmetic (~1.5 us less than aligned_empty per small eager result). Every array gets bytes no
    other array got: a block is never handed out twice; numpy frees it once no array cut from it is left. Arrays
    larger than a quarter of a block get their own allocation."""

    def __init__(self, alignment, block_bytes=64 << 10):
        self._alignment = alignment
        self._block_bytes = block_bytes
        self._largest = block_bytes // 4
        self._typed = {}                  # dtype -> the current block viewed as that dtype
        self._next = block_bytes          # where the next array starts: a full block makes the first call cut one
        self._lock = threading.Lock()

    def empty(self, shape, dtype):
        dtype = np.dtype(dtype)
        count = math.prod(shape)
        nbytes = count * dtype.itemsize
        if nbytes > self._largest:
            return aligned_empty(shape, dtype, self._alignment)
        with self._lock:
            start = self._next
            if start + nbytes > self._block_bytes:
                self._typed = {np.dtype(np.uint8): aligned_empty((self._block_bytes,), np.uint8, self._alignment)}
                start = 0
            # the next array starts on the next alignment boundary (at least one boundary on: no two share bytes)
            self._next = start + (nbytes // self._alignment + 1) * self._alignment
            typed = self._typed.get(dtype)
            if typed is None:
                typed = self._typed[dtype] = self._typed[np.dtype(np.uint8)].view(dtype)
        first = start // dtype.itemsize
        return typed[first:first + count].reshape(shape)
