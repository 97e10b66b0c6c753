"""The ring schedule on its own: N ranks simulated by threads in one process, messages passed through queues.

Checks what MPI tests can't see directly: results vs numpy for odd layouts, that each rank sends exactly the
bandwidth-optimal (N-1)/N of the data, that no message exceeds a segment, and that segments really pipeline.
"""
import queue
import threading

import numpy as np
import pytest

from ringtrain.config import Config
from ringtrain.ops import DTYPES, ReduceOp
from ringtrain.transports.ring import RingTransport
from ringtrain.transports.base import even_counts, offsets
from ringtrain.engine.watchdog import Watchdog


class FakeComm:
    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def Get_rank(self):
        return self._rank

    def Get_size(self):
        return self._size


class ThreadRing(RingTransport):
    """Eager sends into per-link queues; a receive completes when its message has arrived."""

    def __init__(self, rank, size, links, config, depth):
        super().__init__(FakeComm(rank, size), config, Watchdog())
        self.links = links
        self.pipeline_depth = depth
        self.sent_elements = 0
        self.largest_message = 0
        self.outstanding = 0
        self.most_outstanding = 0

    def start_sendrecv(self, send_view, dest, recv_view, source):
        if send_view is not None:
            self.links[(self.rank, dest)].put(send_view.copy())
            self.sent_elements += send_view.size
            self.largest_message = max(self.largest_message, send_view.nbytes)
        self.outstanding += 1
        self.most_outstanding = max(self.most_outstanding, self.outstanding)
        return {"recv": recv_view, "source": source, "done": recv_view is None}

    def test(self, pending):
        if not pending["done"]:
            try:
                message = self.links[(pending["source"], self.rank)].get_nowait()
            except queue.Empty:
                return False
            assert message.size == pending["recv"].size, "neighbours disagree on a segment"
            pending["recv"][...] = message
            pending["done"] = True
        if pending.get("counted") is None:
            pending["counted"] = True
            self.outstanding -= 1
        return True

    def broadcast(self, buf, root):
        raise NotImplementedError

    def alltoall(self, send, send_counts, recv, recv_counts):
        raise NotImplementedError


def run_ranks(size, fn, segment_bytes, depth=2):
    links = {(a, b): queue.Queue() for a in range(size) for b in range(size)}
    rings = [ThreadRing(r, size, links, Config(segment_bytes=segment_bytes), depth) for r in range(size)]
    errors = []

    def body(r):
        try:
            fn(rings[r])
        except BaseException as error:      # surfaced in the main thread below
            errors.append(error)
            for ring in rings:
                ring.watchdog.abort_reason = f"rank {r} failed: {error!r}"

    threads = [threading.Thread(target=body, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "ring schedule deadlocked"
    if errors:
        raise errors[0]
    return rings


def inputs_for(size, count, dtype, seed=0):
    rng = np.random.default_rng([seed, size, count])
    return [rng.integers(-4, 5, count).astype(dtype) for _ in range(size)]


NUMPY_REDUCE = {ReduceOp.SUM: np.sum, ReduceOp.MIN: np.min, ReduceOp.MAX: np.max, ReduceOp.PRODUCT: np.prod}

LAYOUTS = [                      # (ranks, counts)
    (1, [5]),
    (2, [0, 0]),
    (2, [1, 0]),
    (3, [0, 1, 0]),              # more ranks than elements
    (3, [7, 0, 13]),
    (4, [40, 3, 0, 77]),
    (5, even_counts(101, 5)),
]


@pytest.mark.parametrize("size,counts", LAYOUTS)
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_allreduce_matches_numpy_for_uneven_layouts(size, counts, depth):
    data = inputs_for(size, sum(counts), np.float64)
    bufs = [d.copy() for d in data]

    def allreduce(ring):
        ring.reducescatter(bufs[ring.rank], counts, ReduceOp.SUM)
        ring.allgather(bufs[ring.rank], counts)

    run_ranks(size, allreduce, segment_bytes=16, depth=depth)     # 2 float64 per segment: many segments
    want = np.sum(data, axis=0)
    for r in range(size):
        np.testing.assert_array_equal(bufs[r], want, err_msg=f"rank {r}, counts {counts}, depth {depth}")


@pytest.mark.parametrize("op", list(NUMPY_REDUCE))
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16", "int8", "int64"])
def test_reducescatter_leaves_block_r_reduced_on_rank_r(op, dtype_name):
    size, counts = 4, [5, 0, 9, 2]
    data = inputs_for(size, sum(counts), DTYPES[dtype_name], seed=op)
    if op == ReduceOp.PRODUCT:
        data = [np.where(d == 0, 1, np.sign(d)).astype(DTYPES[dtype_name]) for d in data]
    bufs = [d.copy() for d in data]
    run_ranks(size, lambda ring: ring.reducescatter(bufs[ring.rank], counts, op), segment_bytes=4)
    want = NUMPY_REDUCE[op](np.stack([d.astype(np.float64) for d in data]), axis=0)
    for r, start in enumerate(offsets(counts)):
        got = bufs[r][start: start + counts[r]].astype(np.float64)
        np.testing.assert_array_equal(got, want[start: start + counts[r]], err_msg=f"rank {r} block {r}")


def test_each_rank_sends_the_bandwidth_optimal_share_in_segments():
    size, counts, segment_bytes = 4, [1000, 10, 0, 333], 64
    bufs = [d.copy() for d in inputs_for(size, sum(counts), np.float32)]
    rings = run_ranks(size, lambda ring: ring.reducescatter(bufs[ring.rank], counts, ReduceOp.SUM), segment_bytes)
    for ring in rings:
        # reduce-scatter forwards every block except the one the rank ends up owning
        assert ring.sent_elements == sum(counts) - counts[ring.rank]
        assert ring.largest_message <= segment_bytes
        assert ring.most_outstanding == 2        # receive k+1 while reducing k

    rings = run_ranks(size, lambda ring: ring.allgather(bufs[ring.rank], counts), segment_bytes)
    for ring in rings:
        # allgather forwards every block except the one it receives last (its right neighbour's)
        assert ring.sent_elements == sum(counts) - counts[(ring.rank + 1) % size]


def test_layout_errors_name_the_rank():
    ring = ThreadRing(0, 2, {}, Config(), 2)
    with pytest.raises(ValueError, match="rank 0: counts .* sum to 5 but the buffer has 6"):
        ring.reducescatter(np.zeros(6), [2, 3], ReduceOp.SUM)
    with pytest.raises(ValueError, match="3 blocks for a ring of 2"):
        ring.allgather(np.zeros(6), [2, 2, 2])


def test_a_dead_neighbour_ends_the_wait_with_rank_failure():
    from ringtrain.errors import RankFailureError
    ring = ThreadRing(0, 2, {(a, b): queue.Queue() for a in range(2) for b in range(2)}, Config(), 2)
    ring.watchdog.abort_reason = "rank 1 is gone (test)"
    with pytest.raises(RankFailureError, match="rank 1 is gone.*ring reduce-scatter step 0"):
        ring.reducescatter(np.ones(8), [4, 4], ReduceOp.SUM)    # nobody ever sends to rank 0


def test_a_neighbour_that_never_sends_is_a_stall_error_after_the_timeout():
    from ringtrain.errors import StallError
    ring = ThreadRing(1, 3, {(a, b): queue.Queue() for a in range(3) for b in range(3)},
                      Config(stall_timeout_s=0.2), 2)
    with pytest.raises(StallError, match=r"rank 1: no progress for 0.2 s in ring allgather step 0 segment 0 "
                                         r"\(rank 1 <- rank 0, -> rank 2\)"):
        ring.allgather(np.ones(9), [3, 3, 3])
