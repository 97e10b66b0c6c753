"""`mpi_staged`: device arrays through host memory over the host MPI ring -- the fallback that works anywhere
(GPUs on several nodes without NCCL, or any setup the device transports refuse).

    t = HostStagedTransport(MPI.COMM_WORLD.Dup(), Config(), Watchdog())
    t.allreduce(cupy_buffer, ReduceOp.SUM)       # device -> pinned host -> MPI ring -> device

Copies go through one pinned host buffer (page-locked memory is what lets cudaMemcpyAsync run at full PCIe
speed) on the engine's comm stream; the host part is ringtrain.transports.mpi.MPITransport, unchanged.
"""
import cupy
import cupyx
import numpy as np

from .. import gpu
from .base import Transport
from .mpi import MPITransport


class HostStagedTransport(Transport):
    name = "mpi_staged"
    device = "cuda"

    def __init__(self, comm, config, watchdog):
        super().__init__(comm, config, watchdog)
        self._host = MPITransport(comm, config, watchdog)   # owns (and frees) comm
        self._stream = gpu.enter_comm_stream()
        self._spin_s = config.gpu_spin_us * 1e-6
        self._staging = gpu.GrowingBuffer()
        self._pinned = None

    def staging_buffer(self, nbytes):
        return self._staging.get(nbytes)

    def _host_bytes(self, nbytes):
        if self._pinned is None or self._pinned.nbytes < nbytes:
            self._pinned = cupyx.empty_pinned(max(int(nbytes), 1), dtype=np.uint8)
        return self._pinned[:nbytes]

    def _to_host(self, buf, host_bytes=None):
        """A host array with buf's contents (dtype and length of buf), copied on the comm stream and waited for."""
        gpu.enter_comm_stream()
        host = self._host_bytes(buf.nbytes) if host_bytes is None else host_bytes
        if buf.nbytes:
            buf.reshape(-1).view(cupy.uint8).get(out=host, stream=self._stream)
        self._drain("device-to-host copy")
        return host.view(buf.dtype)

    def _to_device(self, host, buf):
        if buf.nbytes:
            buf.reshape(-1).view(cupy.uint8).set(host.view(np.uint8), stream=self._stream)
        # the pinned buffer is reused by the next collective: the upload must finish before we return
        self._drain("host-to-device copy")

    def _drain(self, what):
        # local copies only: the stream always drains
        gpu.drain(self._stream, self._spin_s)

    def allreduce(self, buf, op):
        host = self._to_host(buf)
        self._host.allreduce(host, op)
        self._to_device(host, buf)

    def reducescatter(self, buf, counts, op):
        host = self._to_host(buf)
        self._host.reducescatter(host, counts, op)
        self._to_device(host, buf)

    def allgather(self, buf, counts):
        host = self._to_host(buf)
        self._host.allgather(host, counts)
        self._to_device(host, buf)

    def broadcast(self, buf, root):
        host = self._to_host(buf)
        self._host.broadcast(host, root)
        self._to_device(host, buf)

    def alltoall(self, send, send_counts, recv, recv_counts):
        pinned = self._host_bytes(send.nbytes + recv.nbytes)
        host_send = self._to_host(send, pinned[:send.nbytes])
        host_recv = pinned[send.nbytes:].view(recv.dtype)
        self._host.alltoall(host_send, send_counts, host_recv, recv_counts)
        self._to_device(host_recv, recv)

    def close(self):
        self._host.close()
        self._staging.release()
        self._pinned = None
