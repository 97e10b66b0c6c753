"""GPU transport for ranks of one node, including N processes sharing ONE GPU (which NCCL refuses):
each rank owns a device window (a plain cudaMalloc), shares it by cudaIpcGetMemHandle (handles exchanged with
one MPI allgather) and maps every peer's window, so kernels read peers' memory directly.

    t = CudaIPCTransport(MPI.COMM_WORLD.Dup(), Config(), Watchdog())
    x = t.staging_buffer(n * 4).view(cupy.float32)      # the window itself: writing x is the copy-in
    x[...] = rank
    t.allreduce(x, ReduceOp.SUM)

Allreduce over blocks (block r belongs to rank r):
  1. inputs in the windows, then sync;
  2. reduce-scatter: rank r reduces its block r, reading block r of every peer's window with our kernel;
  3. sync; allgather: rank r copies block p from owner p's window, all blocks in one batched launch;
  4. sync, so no peer still reads our window when the next collective overwrites it.
A "sync" is: this rank's comm stream drained (gpu.drain: polled, then a blocking-sync event), then a flag
barrier in node-shared host memory (flag_barrier.FlagBarrier: a sequence number per rank, polled through the
Watchdog; no MPI call, and a missing rank is named after stall_timeout_s). MPI_Ibarrier cost about 0.85 ms per
call for the three syncs on an H100 host; a flag write is visible to a polling peer within a microsecond. Each
step only reads memory that no rank writes in that step (peers read our block r only after it is final; we write
blocks p != r that nobody reads), so the three barriers are all the ordering needed.

Every rank must call each collective with the same buffer size (true for the engine's fusion buckets); a buffer
that is not the window is copied in and out. The window grows collectively (MPI allreduce of the size).
"""
import cupy
from mpi4py import MPI

from .. import gpu, kernels, ops
from ..errors import TransportError
from .base import Transport, even_counts, offsets
from .flag_barrier import FlagBarrier

_WINDOW_ALIGN = 2 << 20     # windows grow in 2 MiB steps (the IPC mapping granularity on current GPUs)


class CudaIPCTransport(Transport):
    name = "cuda_ipc"
    device = "cuda"

    def __init__(self, comm, config, watchdog):
        super().__init__(comm, config, watchdog)
        self._stream = gpu.enter_comm_stream()
        self._device = gpu.bound_device()
        self._memory = None        # our cupy.cuda.Memory (cudaMalloc: IPC handles cover whole allocations)
        self._window = None        # uint8 view of it
        self._peers = {}           # rank -> uint8 cupy array over the peer's mapped window
        self._peer_ptrs = []
        self._flags = FlagBarrier.on_node(comm, watchdog, config.stall_timeout_s, "cuda_ipc") if self.size > 1 else None
        self._closed = False
        self._spin_s = config.gpu_spin_us * 1e-6

    # ---- the window ----------------------------------------------------------------------------------------
    def _ensure_window(self, nbytes, agreed):
        """Make every window >= nbytes. `agreed`: all ranks pass the same nbytes, so no size exchange is needed."""
        if not agreed:
            nbytes = self.comm.allreduce(int(nbytes), op=MPI.MAX)
        if self._window is not None and self._window.nbytes >= nbytes:
            return
        self._sync("window resize")          # nobody may still read the old windows
        self._unmap_peers()
        size = max(_WINDOW_ALIGN, -(-int(nbytes) // _WINDOW_ALIGN) * _WINDOW_ALIGN)
        with cupy.cuda.Device(self._device):
            self._memory = cupy.cuda.memory.Memory(size)
            self._window = cupy.ndarray((size,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(self._memory, 0))
        handle = cupy.cuda.runtime.ipcGetMemHandle(self._memory.ptr)
        handles = self.comm.allgather(handle)
        for peer, peer_handle in enumerate(handles):
            if peer == self.rank:
                continue
            try:
                ptr = cupy.cuda.runtime.ipcOpenMemHandle(peer_handle, cupy.cuda.runtime.cudaIpcMemLazyEnablePeerAccess)
            except cupy.cuda.runtime.CUDARuntimeError as e:
                raise TransportError(f"rank {self.rank}: cannot map rank {peer}'s GPU window by CUDA IPC: {e} "
                                     "(cuda_ipc needs all ranks on one node; use transport='mpi_staged')") from e
            self._peer_ptrs.append(ptr)
            memory = cupy.cuda.UnownedMemory(ptr, size, self, device_id=self._device)
            self._peers[peer] = cupy.ndarray((size,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))
        self._sync("window exchange")

    def _unmap_peers(self):
        self._peers.clear()
        for ptr in self._peer_ptrs:
            try:
                cupy.cuda.runtime.ipcCloseMemHandle(ptr)
            except Exception:
                pass
        self._peer_ptrs = []

    def staging_buffer(self, nbytes):
        """The window itself: the engine's pack is then the copy-in. Collective (same nbytes on every rank)."""
        self._ensure_window(nbytes, agreed=True)
        return self._window[:nbytes]

    def _place(self, buf, agreed=True):
        """(window view holding buf's elements, whether buf had to be copied in). buf inside our window stays."""
        if self._window is not None:
            start = buf.data.ptr - self._window.data.ptr
            if 0 <= start and start + buf.nbytes <= self._window.nbytes:
                return buf, False
        self._ensure_window(buf.nbytes, agreed)
        return self._window[:buf.nbytes].view(buf.dtype), True

    def _peer_view(self, peer, local_view):
        """The same elements as local_view (inside our window) in peer's window."""
        start = local_view.data.ptr - self._window.data.ptr
        return self._peers[peer][start:start + local_view.nbytes].view(local_view.dtype)

    # ---- synchronisation -----------------------------------------------------------------------------------
    def _sync(self, what):
        # Only this process's own kernels are on the stream (no GPU-side waits on peers), so it always drains.
        gpu.drain(self._stream, self._spin_s)
        if self._flags is not None:
            self._flags.arrive(what)

    # ---- collectives ---------------------------------------------------------------------------------------
    def allreduce(self, buf, op):
        counts = even_counts(buf.size, self.size)
        self._reduce_blocks(buf, counts, op, gather=True)

    def reducescatter(self, buf, counts, op):
        self.check_counts(buf, counts)
        self._reduce_blocks(buf, counts, op, gather=False)

    def _reduce_blocks(self, buf, counts, op, gather):
        op = ops.as_op(op)
        ops.check_op_dtype(op, buf.dtype)
        if self.size == 1 or buf.size == 0:
            return
        gpu.enter_comm_stream()
        view, copied = self._place(buf)
        if copied:
            self._copy(view, buf)
        starts = offsets(counts)
        self._sync("reduce-scatter")
        mine = view[starts[self.rank]: starts[self.rank] + counts[self.rank]]
        # start with the next rank so that, at any moment, ranks read different peers' memory
        for step in range(1, self.size):
            peer = (self.rank + step) % self.size
            kernels.reduce(mine, self._peer_view(peer, mine), op, stream=self._stream)
        if gather:
            self._sync("allgather")
            self._gather_blocks(view, counts, starts)
        self._sync("end of collective")
        if copied:
            self._copy(buf, view)

    def _gather_blocks(self, view, counts, starts):
        pairs = []
        for peer in range(self.size):
            if peer != self.rank and counts[peer]:
                block = view[starts[peer]: starts[peer] + counts[peer]]
                pairs.append((block, self._peer_view(peer, block)))
        kernels.batched_copy(pairs, self._stream)

    def allgather(self, buf, counts):
        self.check_counts(buf, counts)
        if self.size == 1 or buf.size == 0:
            return
        gpu.enter_comm_stream()
        view, copied = self._place(buf)
        starts = offsets(counts)
        if copied:
            lo, hi = starts[self.rank], starts[self.rank] + counts[self.rank]
            self._copy(view[lo:hi], buf[lo:hi])
        self._sync("allgather")
        self._gather_blocks(view, counts, starts)
        self._sync("end of allgather")
        if copied:
            self._copy(buf, view)

    def broadcast(self, buf, root):
        if self.size == 1 or buf.size == 0:
            return
        gpu.enter_comm_stream()
        view, copied = self._place(buf)
        if copied and self.rank == root:
            self._copy(view, buf)
        self._sync(f"broadcast from rank {root}")
        if self.rank != root:
            kernels.batched_copy([(view, self._peer_view(root, view))], self._stream)
        self._sync("end of broadcast")
        if copied and self.rank != root:
            self._copy(buf, view)

    def alltoall(self, send, send_counts, recv, recv_counts):
        if len(send_counts) != self.size or len(recv_counts) != self.size:
            raise ValueError(f"rank {self.rank}: alltoall needs {self.size} send and recv counts, "
                             f"got {list(send_counts)} and {list(recv_counts)}")
        gpu.enter_comm_stream()
        # sizes differ per rank: agree on the window size and learn where each peer put our block
        everyone = self.comm.allgather([int(c) for c in send_counts])
        self._ensure_window(send.nbytes, agreed=False)
        window = self._window[:send.nbytes].view(send.dtype)
        self._copy(window, send)
        self._sync("alltoall")
        pairs, recv_at = [], offsets(recv_counts)
        for peer in range(self.size):
            n = recv_counts[peer]
            if n != everyone[peer][self.rank]:
                raise ValueError(f"rank {self.rank}: alltoall expects {n} elements from rank {peer}, "
                                 f"which sends {everyone[peer][self.rank]}")
            if not n:
                continue
            start = offsets(everyone[peer])[self.rank]
            source = window if peer == self.rank else self._peers[peer][:send.nbytes].view(send.dtype)
            pairs.append((recv[recv_at[peer]: recv_at[peer] + n], source[start:start + n]))
        kernels.batched_copy(pairs, self._stream)
        self._sync("end of alltoall")

    def _copy(self, dst, src):
        """Byte copy on the comm stream (dtype-agnostic: cupy has no elementwise kernels for every dtype)."""
        kernels.batched_copy([(dst.reshape(-1), src.reshape(-1))], self._stream)

    def close(self):
        if self._closed:
            return
        self._closed = True
        try:
            self._stream.synchronize()
        except Exception:
            pass
        self._unmap_peers()
        self._window = self._memory = None
        if self._flags is not None:
            self._flags.free()
        if self.comm is not None and self.comm != MPI.COMM_WORLD and self.comm != MPI.COMM_NULL:
            self.comm.Free()
