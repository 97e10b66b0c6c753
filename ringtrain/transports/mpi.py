"""Host transports over MPI: our ring on Isend/Irecv (`mpi`), and MPI's own collectives as a baseline
(`mpi_allreduce`).

    from mpi4py import MPI
    from ringtrain.config import Config
    from ringtrain.engine.watchdog import Watchdog
    from ringtrain.transports.mpi import MPITransport

    t = MPITransport(MPI.COMM_WORLD.Dup(), Config(), Watchdog())
    x = np.full(10, MPI.COMM_WORLD.rank, np.float32)
    t.allreduce(x, ReduceOp.SUM)          # x == sum of ranks everywhere
    t.close()

Every wait goes through the Watchdog (Testall polling), never a blocking MPI_Wait, so a dead peer or an engine
abort ends the collective with RankFailureError.
"""
import numpy as np
from mpi4py import MPI

from .. import ops
from .ring import RingTransport
from .base import offsets
from . import mpi_util


class MPITransport(mpi_util.NonblockingBroadcastAlltoall, RingTransport):
    """The segmented, pipelined ring (ringtrain/transports/ring.py) with MPI point-to-point messages; any node count."""

    name = "mpi"
    device = "cpu"

    def __init__(self, comm, config, watchdog):
        super().__init__(comm, config, watchdog)
        self._wire = mpi_util.WireTypes()
        self._limit = config.max_message_elements
        self._closed = False

    # ---- ring primitives -----------------------------------------------------------------------------------

    def start_sendrecv(self, send_view, dest, recv_view, source):
        requests = []
        # post the receive first so an eager send from the neighbour lands straight in our buffer
        if recv_view is not None:
            requests += mpi_util.irecv_split(self.comm, recv_view, source, mpi_util.RING_TAG, self._wire, self._limit)
        if send_view is not None:
            self.watchdog.check_sendable("a ring step")     # never a send after this world was aborted
            requests += mpi_util.isend_split(self.comm, send_view, dest, mpi_util.RING_TAG, self._wire, self._limit)
        return requests

    def test(self, pending):
        return MPI.Request.Testall(pending)

    def close(self):
        if self._closed:
            return
        self._closed = True
        self._wire.free()
        if self.comm != MPI.COMM_NULL and self.comm != MPI.COMM_WORLD:
            self.comm.Free()


class MPIAllreduceTransport(MPITransport):
    """Baseline: MPI's own Iallreduce / Ireduce_scatter / Iallgatherv (waited on through the Watchdog).

    MPI cannot reduce float16 or bfloat16 portably (no standard datatype), so those dtypes fall back to the ring
    of MPITransport. Transfers above max_message_elements are split: allreduce into independent pieces,
    reduce-scatter into a pieced allreduce (moves more bytes, but this path only exists for > 2**31 elements),
    allgather into per-block broadcasts.
    """

    name = "mpi_allreduce"

    def allreduce(self, buf, op):
        op = ops.as_op(op)
        mpi_type = mpi_util.reduce_type(buf.dtype)
        if mpi_type is None:
            return super().allreduce(buf, op)      # the ring: MPI has no float16/bfloat16 reduction
        if self.size == 1:
            return
        mpi_op = mpi_util.reduce_op(op, buf.dtype)
        data = mpi_util.raw(buf)
        requests = [self.comm.Iallreduce(MPI.IN_PLACE, [data[lo * buf.itemsize: hi * buf.itemsize], hi - lo, mpi_type],
                                         op=mpi_op)
                    for lo, hi in mpi_util.pieces(buf.size, self._limit)]
        self.watchdog.wait_requests(requests, "MPI_Iallreduce")

    def reducescatter(self, buf, counts, op):
        op = ops.as_op(op)
        self._check_layout(buf, counts)
        mpi_type = mpi_util.reduce_type(buf.dtype)
        if mpi_type is None:
            return super().reducescatter(buf, counts, op)
        if self.size == 1:
            return
        if buf.size > self._limit:
            return self.allreduce(buf, op)         # a superset of the result; only reached past the count limit
        mine = np.empty(counts[self.rank], dtype=buf.dtype)
        request = self.comm.Ireduce_scatter([mpi_util.raw(buf), buf.size, mpi_type],
                                            [mpi_util.raw(mine), mine.size, mpi_type],
                                            list(counts), op=mpi_util.reduce_op(op, buf.dtype))
        self.watchdog.wait_requests([request], "MPI_Ireduce_scatter")
        start = offsets(counts)[self.rank]
        buf[start: start + mine.size] = mine

    def allgather(self, buf, counts):
        self._check_layout(buf, counts)
        if self.size == 1:
            return
        starts = offsets(counts)
        if buf.size > self._limit:
            requests = []
            for owner, (start, count) in enumerate(zip(starts, counts)):
                requests += mpi_util.ibcast_split(self.comm, buf[start: start + count], owner, self._wire,
                                                  self._limit)
            self.watchdog.wait_requests(requests, "allgather as broadcasts")
            return
        dt = self._wire.get(buf.itemsize)
        request = self.comm.Iallgatherv(MPI.IN_PLACE, [mpi_util.raw(buf), (list(counts), starts), dt])
        self.watchdog.wait_requests([request], "MPI_Iallgatherv")


