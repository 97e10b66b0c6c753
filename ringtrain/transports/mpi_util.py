"""Small mpi4py helpers shared by the host transports: wire datatypes, size-split nonblocking calls, reduce types.

MPI counts are C ints, so every transfer is cut into pieces of at most `config.max_message_elements` elements
(tests set it tiny to prove the > 2**31-element path works). Data moves as opaque elements of `itemsize` bytes
(a contiguous MPI type of that many bytes), which works for every dtype, bfloat16 and float16 included, because
point-to-point, broadcast and alltoall never interpret the values.
"""
import numpy as np
from mpi4py import MPI

from ..errors import TransportError, UnsupportedDtypeError
from ..ops import ReduceOp
from .base import offsets

RING_TAG = 0x52           # the ring's point-to-point messages; each transport owns its communicator,
ALLTOALL_TAG = 0x53       # so a fixed tag per message kind is enough to keep them apart


class WireTypes:
    """Committed MPI datatypes `itemsize` bytes wide, one per width, freed by free()."""

    def __init__(self):
        self._types = {1: MPI.BYTE}

    def get(self, itemsize):
        dt = self._types.get(itemsize)
        if dt is None:
            dt = self._types[itemsize] = MPI.BYTE.Create_contiguous(itemsize).Commit()
        return dt

    def free(self):
        for itemsize, dt in list(self._types.items()):
            if itemsize != 1:
                dt.Free()
        self._types = {1: MPI.BYTE}


def one_node_comm(comm, needed_by, advice=""):
    """comm's ranks as one shared-memory communicator (same rank order), for a transport that maps its peers'
    memory; TransportError when some rank of comm lives on another node."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    if node.Get_size() != comm.Get_size():
        node_size = node.Get_size()
        node.Free()
        raise TransportError(f"{needed_by} needs every rank on one node, but rank {comm.Get_rank()} shares its "
                             f"node with {node_size} of {comm.Get_size()} ranks{advice}")
    return node


def raw(array):
    """The array's memory as a uint8 view (numpy can't export bfloat16 through the buffer protocol)."""
    return array.view(np.uint8)


def pieces(count, limit):
    """[(start, stop)] ranges of at most `limit` elements covering 0..count (empty list for count 0)."""
    limit = max(1, int(limit))
    return [(lo, min(lo + limit, count)) for lo in range(0, count, limit)]


def isend_split(comm, array, dest, tag, wire, limit):
    dt = wire.get(array.itemsize)
    return [comm.Isend([raw(array[lo:hi]), hi - lo, dt], dest=dest, tag=tag) for lo, hi in pieces(array.size, limit)]


def irecv_split(comm, array, source, tag, wire, limit):
    dt = wire.get(array.itemsize)
    return [comm.Irecv([raw(array[lo:hi]), hi - lo, dt], source=source, tag=tag)
            for lo, hi in pieces(array.size, limit)]


def ibcast_split(comm, array, root, wire, limit):
    """Nonblocking broadcast of a 1-D contiguous array in pieces; every rank posts the same pieces in order."""
    dt = wire.get(array.itemsize)
    return [comm.Ibcast([raw(array[lo:hi]), hi - lo, dt], root=root) for lo, hi in pieces(array.size, limit)]


def alltoall_split(comm, send, send_counts, recv, recv_counts, wire, limit, watchdog):
    """Alltoallv as rounds of Ialltoallv, each moving at most `limit` elements per peer. Ranks agree on the
    number of rounds with one small Iallreduce (only counts for this rank's own peers are known locally)."""
    size = comm.Get_size()
    if len(send_counts) != size or len(recv_counts) != size:
        raise ValueError(f"rank {comm.Get_rank()}: alltoall needs {size} send and recv counts, "
                         f"got {list(send_counts)} and {list(recv_counts)}")
    if sum(send_counts) != send.size or sum(recv_counts) != recv.size:
        raise ValueError(f"rank {comm.Get_rank()}: alltoall counts {list(send_counts)} / {list(recv_counts)} "
                         f"do not match buffer sizes {send.size} / {recv.size}")
    if send.dtype != recv.dtype:
        raise TypeError(f"rank {comm.Get_rank()}: alltoall send dtype {send.dtype} != recv dtype {recv.dtype}")
    limit = max(1, int(limit))
    mine = np.array([max([0] + [-(-c // limit) for c in list(send_counts) + list(recv_counts)])], dtype=np.int64)
    rounds = np.zeros(1, dtype=np.int64)
    watchdog.wait_requests([comm.Iallreduce(mine, rounds, op=MPI.MAX)], "alltoall round count")
    dt = wire.get(send.itemsize)
    send_displs, recv_displs = offsets(send_counts), offsets(recv_counts)
    # keep the buffer objects alive until the requests complete
    sbuf, rbuf = raw(send), raw(recv)
    requests = []
    for j in range(int(rounds[0])):
        sc = [max(0, min(limit, c - j * limit)) for c in send_counts]
        rc = [max(0, min(limit, c - j * limit)) for c in recv_counts]
        sd = [d + j * limit for d in send_displs]
        rd = [d + j * limit for d in recv_displs]
        # clamp displacements of empty pieces so they stay inside the buffer
        sd = [d if c else 0 for d, c in zip(sd, sc)]
        rd = [d if c else 0 for d, c in zip(rd, rc)]
        requests.append(comm.Ialltoallv([sbuf, (sc, sd), dt], [rbuf, (rc, rd), dt]))
    watchdog.wait_requests(requests, "alltoall")


# numpy dtype name -> MPI datatype MPI can *reduce* (float16/bfloat16 have none MPICH reduces portably)
_REDUCE_TYPES = {
    "float32": MPI.FLOAT,
    "float64": MPI.DOUBLE,
    "int8": MPI.INT8_T,
    "uint8": MPI.UINT8_T,
    "int16": MPI.INT16_T,
    "uint16": MPI.UINT16_T,
    "int32": MPI.INT32_T,
    "int64": MPI.INT64_T,
    "bool": MPI.C_BOOL,
}


def reduce_type(dtype):
    """MPI datatype MPI_Allreduce can reduce for this dtype, or None (float16, bfloat16)."""
    return _REDUCE_TYPES.get(np.dtype(dtype).name)


def reduce_op(op, dtype):
    """MPI op of a ReduceOp; bool reduces logically (Min = and, Max = or) as ops.check_op_dtype defines."""
    if np.dtype(dtype) == np.bool_:
        if op == ReduceOp.MIN:
            return MPI.LAND
        if op == ReduceOp.MAX:
            return MPI.LOR
        raise UnsupportedDtypeError(f"op {ReduceOp(op).name.title()} is not defined for bool; use Min or Max")
    table = {ReduceOp.AVERAGE: MPI.SUM, ReduceOp.SUM: MPI.SUM, ReduceOp.MIN: MPI.MIN,
             ReduceOp.MAX: MPI.MAX, ReduceOp.PRODUCT: MPI.PROD}
    try:
        return table[ReduceOp(op)]
    except (KeyError, ValueError):
        raise TransportError(f"no MPI op for {op!r}") from None


class NonblockingBroadcastAlltoall:
    """broadcast and alltoall for host transports: split nonblocking MPI calls waited through the watchdog.
    Mixed in before Transport; needs self.comm, self.size, self.watchdog, self._wire and self._limit.
    Each collective starts only while its world was not aborted (Watchdog.check_sendable): it sends to peers."""

    def broadcast(self, buf, root):
        if self.size == 1:
            return
        what = f"broadcast from rank {root}"
        self.watchdog.check_sendable(what)
        self.watchdog.wait_requests(ibcast_split(self.comm, buf, root, self._wire, self._limit), what)

    def alltoall(self, send, send_counts, recv, recv_counts):
        self.watchdog.check_sendable("alltoall")
        alltoall_split(self.comm, send, send_counts, recv, recv_counts, self._wire, self._limit, self.watchdog)
