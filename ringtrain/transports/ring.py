"""The ring schedule: reduce-scatter and allgather over point-to-point primitives, segmented and pipelined.

Pure schedule logic. A subclass supplies four primitives and gets `reducescatter`, `allgather` and (through
Transport.allreduce) the bandwidth-optimal ring allreduce:

    class MyTransport(RingTransport):
        def start_sendrecv(self, send_view, dest, recv_view, source): ...   # -> pending handle
        def test(self, pending): ...                                          # -> True once both halves are done
        def reduce(self, dst, src, op): ...                                   # dst <- dst (op) src
        def recv_scratch(self, slot, nbytes): ...                             # reusable 1-D uint8 buffer

Buffers may be numpy or cupy arrays: this module only slices them and reads `.size`, `.itemsize`, `.dtype`
and calls `.view(dtype)`, so the GPU transports reuse the same schedule with their own primitives.

Schedule (N ranks, rank r, block b lives at offsets(counts)[b]):
- reduce-scatter, step s = 0..N-2: send block (r-s) mod N to r+1, receive block (r-s-1) mod N from r-1 into
  scratch and reduce it into our copy. After N-1 steps block (r+1) mod N is complete on rank r -- so we shift
  the block index by one (send block (r-s-1), receive (r-s-2)) to finish with block r on rank r, as the
  Transport contract wants.
- allgather, step s = 0..N-2: send block (r-s) mod N to r+1, receive block (r-s-1) mod N from r-1 in place.

Each step's block is cut into segments of `config.segment_bytes`; (step, segment) pairs form one flat task list
and up to `pipeline_depth` tasks are in flight, so segment k+1 is on the wire while segment k is reduced, also
across step boundaries. A task's send may only start once the data it sends is final: the segment it forwards
is the one received (and reduced) by the same segment index of the previous step.
"""
import collections

from .. import ops
from ..errors import StallError
from .base import Transport, offsets


class RingTransport(Transport):
    """Transport whose reducescatter/allgather are the classic ring over subclass point-to-point primitives."""

    name = "ring"
    pipeline_depth = 2     # tasks in flight; 2 = double buffering (receive k+1 while reducing k)

    # ---- primitives a subclass provides ------------------------------------------------------------------

    def start_sendrecv(self, send_view, dest, recv_view, source):
        """Start sending send_view to rank dest and receiving recv_view from rank source; either may be None
        (nothing to send or receive in this task). Return a handle for test()/wait()."""
        raise NotImplementedError

    def test(self, pending):
        """True once both halves of a start_sendrecv have completed (recv_view is filled, send_view reusable)."""
        raise NotImplementedError

    def reduce(self, dst, src, op):
        """dst <- dst (op) src elementwise, in place. Host default: the numpy ufunc of op."""
        ops.reduce_into(dst, src, op)

    def recv_scratch(self, slot, nbytes):
        """A reusable 1-D uint8 buffer of >= nbytes for receive slot `slot` (0..pipeline_depth-1); host default
        keeps numpy arrays and grows them. GPU transports return device memory."""
        scratch = self.__dict__.setdefault("_ring_scratch", {})
        have = scratch.get(slot)
        if have is None or have.nbytes < nbytes:
            import numpy as np
            have = scratch[slot] = np.empty(max(nbytes, 1), dtype=np.uint8)
        return have[:nbytes]

    def wait(self, pending, what):
        """Wait for a pending sendrecv through the watchdog (never a blocking library wait), so a dead peer or
        an engine abort raises RankFailureError instead of hanging, and a neighbour that never answers (the
        ranks run different collectives) becomes a StallError after stall_timeout_s."""
        timeout = self.config.stall_timeout_s
        try:
            self.watchdog.wait(lambda: self.test(pending), what, timeout=timeout)
        except TimeoutError:
            raise StallError(f"rank {self.rank}: no progress for {timeout:g} s in {what}; the ranks are not "
                             f"running the same sequence of collectives") from None

    # ---- the schedule ------------------------------------------------------------------------------------

    def reducescatter(self, buf, counts, op):
        op = ops.as_op(op)
        self._check_layout(buf, counts)
        n, r = self.size, self.rank
        # shifted by one block so that the block completed last on rank r is block r
        self._run_ring(buf, counts,
                       send_block=lambda s: (r - s - 1) % n,
                       recv_block=lambda s: (r - s - 2) % n,
                       op=op, what="ring reduce-scatter")

    def allgather(self, buf, counts):
        self._check_layout(buf, counts)
        n, r = self.size, self.rank
        self._run_ring(buf, counts,
                       send_block=lambda s: (r - s) % n,
                       recv_block=lambda s: (r - s - 1) % n,
                       op=None, what="ring allgather")

    def _check_layout(self, buf, counts):
        if len(counts) != self.size:
            raise ValueError(f"rank {self.rank}: counts has {len(counts)} blocks for a ring of {self.size} ranks")
        if sum(counts) != buf.size:
            raise ValueError(f"rank {self.rank}: counts {list(counts)} sum to {sum(counts)} "
                             f"but the buffer has {buf.size} elements")

    def _segments(self, count, itemsize):
        """[(start, stop)] element ranges of a block of `count` elements cut at segment_bytes."""
        seg = max(1, self.config.segment_bytes // itemsize)
        return [(lo, min(lo + seg, count)) for lo in range(0, count, seg)]

    def _run_ring(self, buf, counts, send_block, recv_block, op, what):
        n = self.size
        if n == 1:
            return
        starts = offsets(counts)
        itemsize = buf.itemsize
        right, left = (self.rank + 1) % n, (self.rank - 1) % n

        # Flat task list. Neighbours agree on every message: what rank r sends at (step, k) is block
        # send_block(s) of r, which is exactly recv_block(s) of rank r+1, so both cut it into the same segments.
        tasks = []
        for s in range(n - 1):
            sb, rb = send_block(s), recv_block(s)
            send_segs, recv_segs = self._segments(counts[sb], itemsize), self._segments(counts[rb], itemsize)
            for k in range(max(len(send_segs), len(recv_segs))):
                send = None
                if k < len(send_segs):
                    lo, hi = send_segs[k]
                    send = buf[starts[sb] + lo: starts[sb] + hi]
                recv = None
                if k < len(recv_segs):
                    lo, hi = recv_segs[k]
                    recv = buf[starts[rb] + lo: starts[rb] + hi]
                tasks.append((s, k, send, recv))

        in_flight = collections.deque()    # (task key, pending, target view, scratch view or None)
        keys_in_flight = set()
        for i, (s, k, send, recv) in enumerate(tasks):
            # our send at (s, k) forwards what we received at (s-1, k); it must have landed (and been reduced)
            while in_flight and (len(in_flight) >= self.pipeline_depth or (s - 1, k) in keys_in_flight):
                self._finish(in_flight, keys_in_flight, op, what)
            landing = recv
            if recv is not None and op is not None:
                landing = self.recv_scratch(i % self.pipeline_depth, recv.size * itemsize).view(buf.dtype)
            pending = self.start_sendrecv(send, right, landing, left)
            in_flight.append(((s, k), pending, recv, landing if landing is not recv else None))
            keys_in_flight.add((s, k))
        while in_flight:
            self._finish(in_flight, keys_in_flight, op, what)

    def _finish(self, in_flight, keys_in_flight, op, what):
        key, pending, target, scratch = in_flight.popleft()
        self.wait(pending, f"{what} step {key[0]} segment {key[1]} (rank {self.rank} <- rank "
                           f"{(self.rank - 1) % self.size}, -> rank {(self.rank + 1) % self.size})")
        if scratch is not None:
            self.reduce(target, scratch, op)
        keys_in_flight.discard(key)
