"""Packing many tensors into one fusion buffer and back (host side; ringtrain.gpu.DeviceOps mirrors it for cupy).

One ring allreduce over a bucket costs the same latency as over one tensor, so small gradients are copied back to back
into a persistent staging buffer (which, for the shared-memory transport, lives in the shared window: packing IS the
copy-in). Averaging's 1/N is fused into the copy-out.
"""
import numpy as np

from ..ops import scale_into
from .result_pool import ResultPool


def ops_for(device):
    """The one place that picks buffer operations: HostOps for numpy arrays, ringtrain.gpu's DeviceOps (cupy
    kernels; imported only when a device array is seen) for 'cuda'."""
    if device == "cpu":
        return HOST_OPS
    from .. import gpu
    return gpu.device_ops()


class HostOps:
    device = "cpu"
    results = ResultPool()     # new result arrays: large ones are reused once the caller dropped them

    @staticmethod
    def pack(srcs, staging):
        """Copy each flat source into consecutive slices of staging (a typed 1-D view). An int entry n zero-fills
        n elements: a rank that joined contributes zeros for tensors it never had."""
        offset = 0
        for src in srcs:
            if isinstance(src, int):
                staging[offset:offset + src] = 0
                offset += src
            else:
                staging[offset:offset + src.size] = src.reshape(-1)
                offset += src.size
        return offset

    @staticmethod
    def unpack(staging, dsts, scale=1.0):
        """Copy consecutive slices of staging into each flat destination, multiplied by scale (an int n skips n)."""
        offset = 0
        for dst in dsts:
            if isinstance(dst, int):
                offset += dst
                continue
            n = dst.size
            scale_into(dst.reshape(-1), staging[offset:offset + n], scale)
            offset += n

    @staticmethod
    def scale(buf, factor):
        scale_into(buf, buf, factor)

    def empty(self, shape, dtype):
        return self.results.empty(shape, dtype)

    @staticmethod
    def zeros(shape, dtype):
        return np.zeros(shape, dtype=dtype)

    @staticmethod
    def copy(array):
        return np.array(array, copy=True, order="C")

    @staticmethod
    def ready_event():
        return None

    @staticmethod
    def wait_event(event):
        pass

    @staticmethod
    def done_event():
        return None


HOST_OPS = HostOps()
