"""The one interface the engine uses to move and reduce bytes among the ranks of a communicator.

Layout conventions shared by every transport (host numpy arrays or cupy device arrays):
- `buf` is a 1-D contiguous array; `counts[r]` is the number of elements of block r; blocks are laid out
  back to back in rank order (block r starts at sum(counts[:r])). `sum(counts) == buf.size`.
- allreduce == reducescatter(buf, counts, op) then allgather(buf, counts), both in place on the same buf.
- `op` is a ReduceOp; AVERAGE is reduced as SUM here: the engine applies the 1/N scale when it unpacks.
- Every wait inside a transport goes through the Watchdog, so a dead peer raises RankFailureError.
- Transports never see tensor names; the engine wraps their errors with the names of the tensors in flight.
"""
import abc


def even_counts(n, size):
    """Split n elements into `size` blocks as evenly as possible (first blocks one larger)."""
    base, extra = divmod(n, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


def offsets(counts):
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out


class Transport(abc.ABC):
    """One instance per communicator per device kind (host or GPU); created at init(), closed at shutdown()."""

    name = "abstract"
    device = "cpu"          # "cpu" for numpy buffers, "cuda" for cupy buffers

    def __init__(self, comm, config, watchdog):
        self.comm = comm    # an mpi4py communicator private to this transport (a Dup of the world)
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.config = config
        self.watchdog = watchdog

    def check_counts(self, buf, counts):
        """ValueError on this rank unless counts has one entry per rank and splits buf exactly."""
        if len(counts) != self.size or sum(counts) != buf.size:
            raise ValueError(f"rank {self.rank}: counts {list(counts)} do not split a buffer of {buf.size} "
                             f"elements into {self.size} blocks")

    def staging_buffer(self, nbytes):
        """A reusable 1-D uint8 buffer of >= nbytes the engine packs a fusion bucket into. Transports that
        reduce straight from shared memory return memory inside their shared window, so packing is the copy-in."""
        have = getattr(self, "_staging", None)
        if have is None or have.nbytes < nbytes:
            import numpy as np
            self._staging = np.empty(max(nbytes, 1), dtype=np.uint8)
        return self._staging[:nbytes]

    def shared_array(self, nbytes):
        """A 1-D uint8 array of nbytes that this transport reduces without copying it in or out (it lives where
        peers can read it), or None when the transport has no such memory (or none left). Valid until close()."""
        return None

    def result_window(self):
        """A 1-D uint8 array, the same at every call, that results of allocating collectives may be carved from
        (result_pool) so the transport reduces into them where they lie, or None when it has no such memory."""
        return None

    def holds(self, buf):
        """True when buf lies in memory this transport shares with its peers (shared_array(), staging_buffer()),
        so an allreduce of it needs no copy in or out."""
        return False

    def allreduce(self, buf, op):
        counts = even_counts(buf.size, self.size)
        self.reducescatter(buf, counts, op)
        self.allgather(buf, counts)

    def allreduce_out(self, src, dst, op, scale=1.0):
        """dst <- scale * (src reduced over all ranks); src is left as it was. Transports that map their peers'
        memory override this to fold the copies into the reduction; the default copies, reduces in place, scales."""
        from ..ops import scale_into
        if dst is not src:
            dst[...] = src
        self.allreduce(dst, op)
        if scale != 1.0:
            scale_into(dst, dst, scale)

    def allreduce_segments(self, src, dst, op, scale=1.0):
        """dst <- scale * (src reduced over all ranks) for Segments (several flat arrays read as one, segments.py;
        dst may be src). The default packs them into the staging buffer, reduces that in place and unpacks; a
        transport that maps its peers' memory overrides it to read and write the arrays where they lie."""
        staging = self.staging_buffer(src.nbytes)[:src.nbytes].view(src.dtype)
        src.copy_to(staging)
        self.allreduce_out(staging, staging, op, scale)
        dst.copy_from(staging)

    def reducescatter_out(self, src, dst, counts, op):
        """Block `rank` of dst <- that block of src reduced over all ranks; src is left as it was, dst's other
        blocks are unspecified. Transports that map their peers' memory override this to read src directly; the
        default copies src into dst and reduces there."""
        if dst is not src:
            dst[...] = src
        self.reducescatter(dst, counts, op)

    @abc.abstractmethod
    def reducescatter(self, buf, counts, op):
        """In place: afterwards block `rank` of buf holds the reduction of that block over all ranks.
        The other blocks are left in an unspecified state."""

    @abc.abstractmethod
    def allgather(self, buf, counts):
        """In place: block `rank` of buf is this rank's input; afterwards every block holds its owner's input."""

    @abc.abstractmethod
    def broadcast(self, buf, root):
        """In place: buf on every rank becomes root's buf."""

    @abc.abstractmethod
    def alltoall(self, send, send_counts, recv, recv_counts):
        """send holds blocks for ranks 0..N-1 (send_counts); recv gets the block from each rank (recv_counts)."""

    def close(self):
        """Release windows, communicators and device resources; must be safe to call twice."""
