"""GPU transports over NCCL (cupy.cuda.nccl): our ring with ncclSend/ncclRecv (`nccl`) and, as a baseline,
ncclAllReduce itself (`nccl_allreduce`). One GPU per rank: NCCL refuses two ranks on one device (use cuda_ipc).

    t = NCCLTransport(MPI.COMM_WORLD.Dup(), Config(), Watchdog())
    x = cupy.full(10, rank, cupy.float32)
    cupy.cuda.Device().synchronize()          # x was written on another stream
    t.allreduce(x, ReduceOp.SUM)              # enqueued on gpu.comm_stream()
    gpu.comm_stream().synchronize()

Everything runs on the engine's communication stream. The ring schedule (ringtrain/transports/ring.py) drives the
messages; our reduce kernel combines each received segment. A segment's completion is an event on the stream
polled through the Watchdog, so a dead peer raises instead of hanging the engine thread; with two segments in
flight the GPU always has the next transfer queued while the host looks at the previous one.
"""
from cupy.cuda import nccl

from .. import gpu, kernels, ops
from ..errors import TransportError
from .ring import RingTransport
from .base import offsets

_NCCL_DTYPES = {
    "float16": nccl.NCCL_FLOAT16, "bfloat16": nccl.NCCL_BFLOAT16, "float32": nccl.NCCL_FLOAT32,
    "float64": nccl.NCCL_FLOAT64, "int8": nccl.NCCL_INT8, "uint8": nccl.NCCL_UINT8, "int32": nccl.NCCL_INT32,
    "int64": nccl.NCCL_INT64, "bool": nccl.NCCL_UINT8,   # bool only reduces by Min/Max: and/or on 0/1 bytes
}
_NCCL_OPS = {ops.ReduceOp.AVERAGE: nccl.NCCL_SUM, ops.ReduceOp.SUM: nccl.NCCL_SUM, ops.ReduceOp.MIN: nccl.NCCL_MIN,
             ops.ReduceOp.MAX: nccl.NCCL_MAX, ops.ReduceOp.PRODUCT: nccl.NCCL_PROD}


class NCCLTransport(RingTransport):
    """The segmented ring of ring.py with NCCL point-to-point transfers and ringtrain's reduce kernel."""

    name = "nccl"
    device = "cuda"

    def __init__(self, comm, config, watchdog):
        super().__init__(comm, config, watchdog)
        self._stream = gpu.enter_comm_stream()
        self._staging = gpu.GrowingBuffer()
        self._scratch = {}
        unique_id = nccl.get_unique_id() if self.rank == 0 else None
        unique_id = comm.bcast(unique_id, root=0)
        try:
            self._nccl = nccl.NcclCommunicator(self.size, unique_id, self.rank)
        except Exception as e:
            raise TransportError(f"rank {self.rank}: NCCL communicator of {self.size} ranks failed on GPU "
                                 f"{gpu.bound_device()}: {e} (ranks sharing one GPU need transport='cuda_ipc')") from e

    # ---- buffers -------------------------------------------------------------------------------------------
    def staging_buffer(self, nbytes):
        return self._staging.get(nbytes)

    def recv_scratch(self, slot, nbytes):
        return self._scratch.setdefault(slot, gpu.GrowingBuffer()).get(nbytes)

    # ---- ring primitives ----------------------------------------------------------------------------------
    def _record(self):
        event = self._stream_event()
        event.record(self._stream)
        return event

    @staticmethod
    def _stream_event():
        import cupy
        return cupy.cuda.Event(block=False, disable_timing=True)

    def start_sendrecv(self, send_view, dest, recv_view, source):
        gpu.enter_comm_stream()
        nccl.groupStart()   # send and receive in one group: NCCL runs them concurrently, no ordering deadlock
        try:
            if recv_view is not None and recv_view.size:
                self._nccl.recv(recv_view.data.ptr, recv_view.nbytes, nccl.NCCL_UINT8, source, self._stream.ptr)
            if send_view is not None and send_view.size:
                self._nccl.send(send_view.data.ptr, send_view.nbytes, nccl.NCCL_UINT8, dest, self._stream.ptr)
        finally:
            nccl.groupEnd()
        return self._record()

    def test(self, pending):
        return pending.done

    def reduce(self, dst, src, op):
        kernels.reduce(dst, src, op, stream=self._stream)

    def _wait_stream(self, what):
        event = self._record()
        self.watchdog.wait(lambda: event.done, what)

    # ---- the other collectives ----------------------------------------------------------------------------
    def broadcast(self, buf, root):
        if self.size == 1:
            return
        gpu.enter_comm_stream()
        self._nccl.bcast(buf.data.ptr, buf.nbytes, nccl.NCCL_UINT8, root, self._stream.ptr)
        self._wait_stream(f"NCCL broadcast from rank {root}")

    def alltoall(self, send, send_counts, recv, recv_counts):
        if len(send_counts) != self.size or len(recv_counts) != self.size:
            raise ValueError(f"rank {self.rank}: alltoall needs {self.size} send and recv counts, "
                             f"got {list(send_counts)} and {list(recv_counts)}")
        gpu.enter_comm_stream()
        item = send.itemsize
        send_at, recv_at = offsets(send_counts), offsets(recv_counts)
        nccl.groupStart()
        try:
            for peer in range(self.size):
                if recv_counts[peer]:
                    self._nccl.recv(recv.data.ptr + recv_at[peer] * item, recv_counts[peer] * item,
                                    nccl.NCCL_UINT8, peer, self._stream.ptr)
                if send_counts[peer]:
                    self._nccl.send(send.data.ptr + send_at[peer] * item, send_counts[peer] * item,
                                    nccl.NCCL_UINT8, peer, self._stream.ptr)
        finally:
            nccl.groupEnd()
        self._wait_stream("NCCL alltoall")

    def close(self):
        communicator, self._nccl = getattr(self, "_nccl", None), None
        if communicator is not None:
            try:
                self._stream.synchronize()
                communicator.destroy()
            except Exception:
                pass
        self._staging.release()
        self._scratch.clear()
        comm, self.comm = self.comm, None
        if comm is not None:
            from mpi4py import MPI
            if comm != MPI.COMM_WORLD and comm != MPI.COMM_NULL:
                comm.Free()


class NCCLAllreduceTransport(NCCLTransport):
    """Baseline: ncclAllReduce for allreduce (the rest as NCCLTransport)."""

    name = "nccl_allreduce"

    def allreduce(self, buf, op):
        op = ops.as_op(op)
        dtype = ops.check_op_dtype(op, buf.dtype)
        if buf.size == 0:
            return
        gpu.enter_comm_stream()   # 1 rank still calls NCCL, so the 1-rank benchmark times its overhead
        self._nccl.allReduce(buf.data.ptr, buf.data.ptr, buf.size, _NCCL_DTYPES[dtype], _NCCL_OPS[op],
                             self._stream.ptr)
        self._wait_stream("ncclAllReduce")
