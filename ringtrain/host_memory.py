"""Keep large freed host blocks in the process, so that a training step's tensors are not handed fresh pages.

    host_memory.keep_freed_blocks(largest_bytes=9 << 20, total_bytes=45 << 20)   # once, when a model is wrapped

A training step frees and allocates the same large host tensors again and again: backward makes a weight's
gradient, adds it into its bucket and frees it. glibc's malloc gives a block of its mmap threshold or more (128 KB
at first, raised by itself up to 32 MB as such blocks are freed) its own mmap and unmaps it when freed, and gives
the top of its heap back to the OS once more than its trim threshold is free there. Either way the next step's
tensor lands on pages the kernel must fault in again, one fault per 4 KB: ResNet-18 trained on 2 ranks here took
6,864 faults (27 MB) per step that way, several milliseconds of CPU a step. Raising both thresholds past the model's
gradients keeps those blocks in the heap for the next step, as PyTorch's caching allocator does on a GPU; the cost
is that memory freed at the top of the heap stays with the process up to the trim threshold.

Nothing is changed where the user chose malloc settings (MALLOC_*_ variables, GLIBC_TUNABLES, an LD_PRELOADed
allocator such as jemalloc or tcmalloc) or where the C library is not glibc.
"""
import ctypes
import os

M_TRIM_THRESHOLD = -1          # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MIN_MMAP_THRESHOLD = 32 << 20  # what glibc's own adjustment may reach: never set lower
MAX_THRESHOLD = 1 << 30
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_",
                 "GLIBC_TUNABLES", "LD_PRELOAD")

_set = (0, 0)                  # (mmap threshold, trim threshold) this process set, 0 = untouched


def _mallopt():
    """glibc's mallopt, or None (another C library, or not Linux)."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version          # glibc only
        mallopt = libc.mallopt
    except (AttributeError, OSError):
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt


def keep_freed_blocks(largest_bytes: int, total_bytes: int) -> bool:
    """Serve host blocks up to twice `largest_bytes` from the heap, and keep up to four times `total_bytes` freed
    at its top (thresholds only ever raised, at most 1 GB). True when the thresholds are set as asked."""
    global _set
    if any(os.environ.get(name) for name in USER_SETTINGS):
        return False
    mallopt = _mallopt()
    if mallopt is None:
        return False
    mmap_threshold = min(MAX_THRESHOLD, max(MIN_MMAP_THRESHOLD, 2 * int(largest_bytes), _set[0]))
    trim_threshold = min(MAX_THRESHOLD, max(2 * mmap_threshold, 4 * int(total_bytes), _set[1]))
    if (mmap_threshold, trim_threshold) == _set:
        return True
    if not (mallopt(M_MMAP_THRESHOLD, mmap_threshold) and mallopt(M_TRIM_THRESHOLD, trim_threshold)):
        return False
    _set = (mmap_threshold, trim_threshold)
    return True
