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


class Rows:
    """Aligned C-contiguous arrays of one shape and dtype, handed out one after another from shared blocks. Every
    array is a row no other array got: a block is never handed out twice (its rows come from one C iterator over
    it, which the GIL steps atomically), and numpy frees a block once no row of it is left. Rows start `alignment`
    apart at least, so no two share bytes. `current` is the block's iterator (next(current, None): None when used
    up, then `refill`)."""

    def __init__(self, shape, dtype, alignment, block_bytes=64 << 10):
        self._shape = tuple(shape)
        self._dtype = np.dtype(dtype)
        self._alignment = alignment
        nbytes = math.prod(self._shape) * self._dtype.itemsize
        self._stride = max(1, -(-nbytes // alignment)) * alignment      # the row's bytes, up to a boundary
        self._count = max(1, block_bytes // self._stride)
        strides, step = [], self._dtype.itemsize
        for extent in reversed(self._shape):
            strides.insert(0, step)
            step *= extent
        self._strides = (self._stride,) + tuple(strides)
        self.current = iter(())
        self._lock = threading.Lock()

    def refill(self, used):
        """A fresh block's iterator in place of `used` (unless another thread replaced it already)."""
        with self._lock:
            if self.current is used:
                raw = aligned_empty((self._count * self._stride,), np.uint8, self._alignment)
                block = np.ndarray((self._count,) + self._shape, self._dtype, buffer=raw, strides=self._strides)
                # iterating a numpy array yields its rows as views; 0-d rows would come out as numpy scalars
                self.current = (iter(block) if self._shape else
                                map(block.__getitem__, [(i, Ellipsis) for i in range(self._count)]))

    def take(self):
        while True:
            current = self.current
            row = next(current, None)
            if row is not None:
                return row
            self.refill(current)


class Results:
    """Small aligned result arrays by (shape, dtype): a Rows per signature seen (at most `signatures`; past that it
    starts again from empty), arrays of more than `largest` bytes their own aligned_empty."""

    def __init__(self, alignment, largest=16 << 10, signatures=256):
        self._alignment = alignment
        self._largest = largest
        self._signatures = signatures
        self._rows = {}

    def empty(self, shape, dtype):
        rows = self._rows.get((shape, dtype))
        if rows is not None:
            row = next(rows.current, None)      # the hot path: one C call
            if row is not None:
                return row
            return rows.take()
        if math.prod(shape) * np.dtype(dtype).itemsize > self._largest:
            return aligned_empty(shape, dtype, self._alignment)
        if len(self._rows) >= self._signatures:
            self._rows = {}
        rows = self._rows[(shape, dtype)] = Rows(shape, dtype, self._alignment, 8 * self._largest)
        return rows.take()
