"""Several flat host arrays of one dtype, read by a transport as one buffer -- so a grouped allreduce of private
arrays can be reduced from where they lie instead of being packed into a bucket and unpacked after.

    seg = Segments([a, b, c])            # views of a, b and c (C-contiguous), back to back, without a copy
    seg[10:50]                           # an ndarray when the range lies in one array, else a Segments
    seg.runs(lo, hi, limit)              # (start, stop) ranges of at most `limit` elements, never across arrays
    seg.copy_to(flat); seg.copy_from(flat)

Why: at 2 ranks a packed bucket costs a pass over all the data to pack it into the shm window and another to copy
the result out; reduced where it lies, only the half a peer reads is copied in and the half it reduced is copied
out (SharedMemoryTransport.allreduce_segments). A transport that cannot read Segments packs them (the default
Transport.allreduce_segments), which is what a grouped allreduce always did.
"""
import bisect

import numpy as np

from .mpi_util import pieces


class Segments:
    __slots__ = ("given", "arrays", "starts", "size", "dtype", "itemsize", "nbytes")

    def __init__(self, arrays):
        self.given = list(arrays)              # as the caller passed them (any shape): a request's arrays
        self.arrays = [a.reshape(-1) for a in self.given]
        self.starts, total = [], 0
        for a in self.arrays:
            self.starts.append(total)
            total += a.size
        self.size = (self.starts[-1] + self.arrays[-1].size) if self.arrays else 0
        self.dtype = self.arrays[0].dtype if self.arrays else np.dtype(np.uint8)
        self.itemsize = self.dtype.itemsize
        self.nbytes = self.size * self.itemsize

    def reshape(self, *shape):
        """Only the flat shape a transport asks for: Segments are 1-D."""
        if shape not in ((-1,), ((-1,),), (self.size,), ((self.size,),)):
            raise ValueError(f"Segments of {self.size} elements are 1-D, not {shape}")
        return self

    def same_layout(self, other):
        return isinstance(other, Segments) and other.starts == self.starts and other.size == self.size

    def _member(self, index):
        """The array holding element `index` (0 <= index < size)."""
        return bisect.bisect_right(self.starts, index) - 1

    def __getitem__(self, key):
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("Segments take a contiguous slice")
        lo, hi, _ = key.indices(self.size)
        hi = max(lo, hi)
        if lo == hi:
            return self.arrays[0][:0] if self.arrays else np.empty(0, self.dtype)
        first, last = self._member(lo), self._member(hi - 1)
        if first == last:
            start = self.starts[first]
            return self.arrays[first][lo - start: hi - start]
        parts = [self.arrays[first][lo - self.starts[first]:]]
        parts += self.arrays[first + 1: last]
        parts.append(self.arrays[last][: hi - self.starts[last]])
        return Segments(parts)

    def runs(self, lo, hi, limit):
        """[(start, stop)] covering lo..hi, each at most `limit` elements and inside one array, so that
        self[start:stop] is an ndarray."""
        limit = max(1, int(limit))
        out = []
        while lo < hi:
            member = self._member(lo)
            end = min(hi, self.starts[member] + self.arrays[member].size, lo + limit)
            out.append((lo, end))
            lo = end
        return out

    def copy_to(self, flat):
        """flat[:] <- the arrays back to back (flat: a 1-D array of `size` elements)."""
        for start, a in zip(self.starts, self.arrays):
            flat[start: start + a.size] = a

    def copy_from(self, flat):
        """The arrays <- consecutive pieces of flat."""
        for start, a in zip(self.starts, self.arrays):
            a[...] = flat[start: start + a.size]


def runs(buf, limit):
    """[(start, stop)] pieces of at most `limit` elements covering a flat ndarray or Segments, each one ndarray."""
    if isinstance(buf, Segments):
        return buf.runs(0, buf.size, limit)
    return pieces(buf.size, limit)


def fill(dst, src):
    """dst[...] = src for a flat ndarray or Segments on either side (same number of elements)."""
    if isinstance(src, Segments):
        if isinstance(dst, Segments):
            for lo, hi in src.runs(0, src.size, src.size):
                fill(dst[lo:hi], src[lo:hi])
        else:
            src.copy_to(dst)
    elif isinstance(dst, Segments):
        dst.copy_from(src)
    else:
        dst[...] = src
