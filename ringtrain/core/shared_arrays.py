"""Arrays the host transport reduces without copies: allocate a buffer you allreduce again and again (a gradient
bucket) with empty_shared() and an in-place allreduce of it neither copies it in nor out.

    bucket = rt.empty_shared(n, np.float32)      # lives in this rank's region of the shm window
    bucket[:] = gradients                        # the one copy you make anyway
    rt.allreduce(bucket, out=bucket)             # peers read it where it lies; the result lands in place

On the shm transport an in-place allreduce of an ordinary array copies the blocks peers read into the shared window
first and the result out afterwards: twice the memory traffic (see transports/shm.py). With any other transport,
when the pool (RINGTRAIN_SHARED_POOL_BYTES, 256 MB per rank by default) is used up, or for arrays larger than
the fusion threshold, empty_shared() is np.empty() and everything works the same, only with the copies.
The memory is never returned before the process exits (see SharedMemoryTransport.shared_array).
"""
import numpy as np

from . import state


def empty_shared(shape: "int | tuple", dtype=np.float32) -> np.ndarray:
    """An uninitialised C-contiguous numpy array, in the shared window when the host transport has one."""
    dtype = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    count = int(np.prod(shape, dtype=np.int64))
    transport = state.engine().transports["cpu"]
    raw = transport.shared_array(count * dtype.itemsize)
    if raw is None:
        return np.empty(shape, dtype)
    return raw.view(dtype).reshape(shape)
