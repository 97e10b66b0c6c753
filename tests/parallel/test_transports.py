"""Each host transport, constructed directly, against a numpy reference computed from every rank's input.

Run: mpiexec -n {2,3,4} python -m pytest --with-mpi tests/parallel/test_transports.py

Inputs are small integers, so every dtype (float16 and bfloat16 included) reduces exactly and results are
compared bit for bit. Configs are tiny on purpose: 128-byte ring segments, 7- and 50-element MPI messages and a
256-byte shared region force the pipelining, message-splitting and chunking paths even on small buffers.
"""
import signal
import time

import numpy as np
import pytest
from mpi4py import MPI

from ringtrain.config import Config
from ringtrain.errors import RankFailureError
from ringtrain.ops import DTYPES, ReduceOp
from ringtrain.transports.base import even_counts, offsets
from ringtrain.engine.watchdog import Watchdog


OPS = [ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT]
SMALL_SIZES = [0, 1, 7, 211]          # 211: prime, several 128-byte ring segments for most dtypes
CONFIGS = {
    "mpi": dict(segment_bytes=128, max_message_elements=7),
    "mpi_allreduce": dict(segment_bytes=64, max_message_elements=50),
    "shm": dict(fusion_threshold=256),
}
TRANSPORTS = list(CONFIGS)


def make_transport(name, **config):
    from ringtrain.transports import transport_class
    return transport_class(name)(MPI.COMM_WORLD.Dup(), Config(**config), Watchdog())


@pytest.fixture(scope="module", params=TRANSPORTS)
def transport(request):
    t = make_transport(request.param, **CONFIGS[request.param])
    if request.param == "shm":
        t.cache_piece_bytes = 96        # reduce-and-push in many pieces
    yield t
    t.close()


def op_dtype_pairs():
    for dtype_name in DTYPES:
        for op in OPS:
            if dtype_name != "bool" or op in (ReduceOp.MIN, ReduceOp.MAX):
                yield op, dtype_name


def rank_inputs(size, dtype_name, op, seed, nranks):
    """Every rank's input (all ranks generate all of them, so each can compute the reference)."""
    out = []
    for r in range(nranks):
        rng = np.random.default_rng([seed, r, size])
        if dtype_name == "bool":
            values = rng.integers(0, 2, size)
        elif op == ReduceOp.PRODUCT:    # |product| <= 2**4: exact even in int8 and bfloat16
            values = rng.choice([1, 2] if DTYPES[dtype_name].kind == "u" else [-1, 1, 2], size)
        else:
            values = rng.integers(0, 11, size) - (0 if DTYPES[dtype_name].kind == "u" else 5)
        out.append(values.astype(DTYPES[dtype_name]))
    return out


def reference(inputs, op):
    stacked = np.stack([x.astype(np.float64) for x in inputs])
    return {ReduceOp.SUM: stacked.sum(0), ReduceOp.MIN: stacked.min(0), ReduceOp.MAX: stacked.max(0),
            ReduceOp.PRODUCT: stacked.prod(0)}[op]


def uneven_counts(size, nranks):
    """Blocks growing with rank (block 0 often empty; several empty when size < nranks)."""
    counts = [size * r * 2 // (nranks * (nranks - 1) or 1) for r in range(nranks)]
    counts[-1] += size - sum(counts)
    return counts


class Mismatches:
    """Collects wrong results instead of asserting at once: a rank that stopped early would leave its peers
    blocked in the next collective. `assert_none()` gathers every rank's findings, so all ranks fail together."""

    def __init__(self):
        self.found = []

    def check(self, got, want, what):
        got = np.asarray(got).astype(np.float64)
        bad = np.flatnonzero(got != want)
        if bad.size:
            self.found.append(f"rank {MPI.COMM_WORLD.rank}: {what}: {bad.size} wrong, first at {bad[0]}: "
                              f"got {got[bad[0]]}, want {want[bad[0]]}")

    def assert_none(self):
        everywhere = [line for lines in MPI.COMM_WORLD.allgather(self.found) for line in lines]
        assert not everywhere, f"{len(everywhere)} wrong results, e.g.\n" + "\n".join(everywhere[:8])


@pytest.mark.mpi(min_size=2)
def test_allreduce_every_op_dtype_size(transport):
    comm = MPI.COMM_WORLD
    wrong = Mismatches()
    for op, dtype_name in op_dtype_pairs():
        for size in SMALL_SIZES:
            inputs = rank_inputs(size, dtype_name, op, 1, comm.size)
            buf = inputs[comm.rank].copy()
            transport.allreduce(buf, op)
            wrong.check(buf, reference(inputs, op), f"{transport.name} allreduce {op.name} {dtype_name} n={size}")
    wrong.assert_none()


@pytest.mark.mpi(min_size=2)
def test_reducescatter_every_op_dtype_uneven_counts(transport):
    comm = MPI.COMM_WORLD
    wrong = Mismatches()
    for op, dtype_name in op_dtype_pairs():
        for size in SMALL_SIZES:
            counts = uneven_counts(size, comm.size)
            start, count = offsets(counts)[comm.rank], counts[comm.rank]
            inputs = rank_inputs(size, dtype_name, op, 2, comm.size)
            buf = inputs[comm.rank].copy()
            transport.reducescatter(buf, counts, op)
            wrong.check(buf[start: start + count], reference(inputs, op)[start: start + count],
                        f"{transport.name} reducescatter {op.name} {dtype_name} counts={counts}")
    wrong.assert_none()


@pytest.mark.mpi(min_size=2)
def test_allgather_every_dtype_uneven_counts(transport):
    comm = MPI.COMM_WORLD
    wrong = Mismatches()
    for dtype_name in DTYPES:
        for size in SMALL_SIZES:
            for counts in (uneven_counts(size, comm.size), even_counts(size, comm.size)):
                inputs = rank_inputs(size, dtype_name, ReduceOp.SUM, 3, comm.size)
                starts = offsets(counts)
                want = np.concatenate([inputs[r][s: s + c] for r, (s, c) in enumerate(zip(starts, counts))])
                buf = np.zeros(size, DTYPES[dtype_name])
                mine = slice(starts[comm.rank], starts[comm.rank] + counts[comm.rank])
                buf[mine] = inputs[comm.rank][mine]
                transport.allgather(buf, counts)
                wrong.check(buf, want.astype(np.float64), f"{transport.name} allgather {dtype_name} counts={counts}")
    wrong.assert_none()


@pytest.mark.mpi(min_size=2)
def test_broadcast_every_dtype_and_root(transport):
    comm = MPI.COMM_WORLD
    wrong = Mismatches()
    for dtype_name in DTYPES:
        for size in SMALL_SIZES:
            for root in sorted({0, comm.size - 1}):
                inputs = rank_inputs(size, dtype_name, ReduceOp.SUM, 4 + root, comm.size)
                buf = inputs[comm.rank].copy()
                transport.broadcast(buf, root)
                wrong.check(buf, inputs[root].astype(np.float64),
                            f"{transport.name} broadcast {dtype_name} n={size} root={root}")
    wrong.assert_none()


@pytest.mark.mpi(min_size=2)
def test_alltoall_uneven_counts(transport):
    comm = MPI.COMM_WORLD
    wrong = Mismatches()
    n, me = comm.size, comm.rank

    def count(src, dst):              # elements src sends to dst: uneven, some zero, some above the split size
        return (3 * src + 7 * dst) % 5 * 13

    def block(src, dst, dtype):
        return ((np.arange(count(src, dst)) + 10 * src + dst) % 100).astype(dtype)

    for dtype_name in DTYPES:
        dtype = DTYPES[dtype_name]
        send_counts = [count(me, d) for d in range(n)]
        recv_counts = [count(s, me) for s in range(n)]
        send = np.concatenate([block(me, d, dtype) for d in range(n)])
        recv = np.zeros(sum(recv_counts), dtype)
        transport.alltoall(send, send_counts, recv, recv_counts)
        want = np.concatenate([block(s, me, dtype) for s in range(n)])
        wrong.check(recv, want.astype(np.float64), f"{transport.name} alltoall {dtype_name}")
    wrong.assert_none()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name,config", [
    ("mpi", dict(segment_bytes=64 << 10, max_message_elements=10007)),      # pipelined segments, split messages
    ("mpi_allreduce", dict(max_message_elements=100003)),                   # split Iallreduce pieces
    ("shm", dict(fusion_threshold=96 << 10)),                               # ~11 chunks of a 1 MB buffer
])
def test_one_megabyte_combined(name, config):
    comm = MPI.COMM_WORLD
    wrong = Mismatches()
    size = (1 << 20) // 4 + 3
    t = make_transport(name, **config)
    try:
        inputs = rank_inputs(size, "float32", ReduceOp.SUM, 5, comm.size)
        want = reference(inputs, ReduceOp.SUM)
        buf = inputs[comm.rank].copy()
        t.allreduce(buf, ReduceOp.SUM)
        wrong.check(buf, want, f"{name} 1 MB allreduce")

        counts = uneven_counts(size, comm.size)
        start, count = offsets(counts)[comm.rank], counts[comm.rank]
        buf = inputs[comm.rank].copy()
        t.reducescatter(buf, counts, ReduceOp.SUM)
        wrong.check(buf[start: start + count], want[start: start + count], f"{name} 1 MB reducescatter")
        t.allgather(buf, counts)
        wrong.check(buf, want, f"{name} 1 MB allgather of the reduced blocks")
        wrong.assert_none()
    finally:
        t.close()


@pytest.mark.mpi(min_size=2)
def test_shm_buffer_in_staging_region_at_rank_dependent_offsets():
    """The engine packs buckets straight into staging_buffer(); the transport must then use it in place (no
    copy-in) and find each peer's data where that peer put it."""
    comm = MPI.COMM_WORLD
    wrong = Mismatches()
    t = make_transport("shm", fusion_threshold=1 << 16)
    t.cache_piece_bytes = 1000
    try:
        for op, dtype_name in [(ReduceOp.SUM, "float32"), (ReduceOp.PRODUCT, "int8"), (ReduceOp.MAX, "bfloat16")]:
            dtype = DTYPES[dtype_name]
            size = 1001
            shift = 8 * comm.rank                 # each rank's bucket starts at a different byte offset
            region = t.staging_buffer(shift + size * dtype.itemsize)
            assert region.nbytes == shift + size * dtype.itemsize
            buf = region[shift:].view(dtype)
            inputs = rank_inputs(size, dtype_name, op, 6, comm.size)
            buf[...] = inputs[comm.rank]
            t.allreduce(buf, op)
            wrong.check(buf, reference(inputs, op), f"shm staged allreduce {op.name} {dtype_name}")
            buf[...] = inputs[comm.rank]
            counts = uneven_counts(size, comm.size)
            start, count = offsets(counts)[comm.rank], counts[comm.rank]
            t.reducescatter(buf, counts, op)
            wrong.check(buf[start: start + count], reference(inputs, op)[start: start + count],
                        f"shm staged reducescatter {op.name} {dtype_name}")
            t.allgather(buf, counts)
            wrong.check(buf, reference(inputs, op), f"shm staged allgather {op.name} {dtype_name}")
        # a bucket larger than the region falls back to private memory, processed in chunks
        big = t.staging_buffer(t.capacity + 4096)
        assert big.nbytes == t.capacity + 4096
        wrong.assert_none()
    finally:
        t.close()


@pytest.mark.mpi(min_size=2)
def test_shm_buffers_pass_the_region_in_cache_sized_chunks():
    """A private buffer that fits the region still passes it in private_chunk_bytes chunks (so what one rank copies
    in is in cache when peers read it); a buffer in the region is reduced where it lies in one chunk -- and in the
    private ranks' chunks when only some ranks' buffers lie in the region."""
    comm = MPI.COMM_WORLD
    wrong = Mismatches()
    t = make_transport("shm", fusion_threshold=1 << 20, stall_timeout_s=20)   # ranks out of step fail fast
    t.private_chunk_bytes = 8192
    t.cache_piece_bytes = 1000
    barriers = []
    real_barrier = t._barrier
    t._barrier = lambda what, **kw: barriers.append(what) or real_barrier(what, **kw)

    def ready_barriers():
        count = barriers.count("ready")
        barriers.clear()
        return count

    try:
        size = 10007                                  # 80 KB of float64: about ten chunks, uneven pieces
        inputs = rank_inputs(size, "float64", ReduceOp.SUM, 8, comm.size)
        want = reference(inputs, ReduceOp.SUM)
        out = np.full(size, -1.0)
        t.allreduce_out(inputs[comm.rank], out, ReduceOp.SUM)
        wrong.check(out, want, "shm private allreduce_out in chunks")
        chunks = ready_barriers()
        assert chunks >= 8, chunks
        counts = uneven_counts(size, comm.size)
        start, count = offsets(counts)[comm.rank], counts[comm.rank]
        out[...] = -1.0
        t.reducescatter_out(inputs[comm.rank], out, counts, ReduceOp.SUM)
        wrong.check(out[start: start + count], want[start: start + count], "shm private reducescatter_out in chunks")
        t.allgather(out, counts)
        wrong.check(out, want, "shm private allgather in chunks")
        assert ready_barriers() == 2 * chunks

        shift = 64 * comm.rank                        # in the region, at an offset that differs between ranks
        shared = t.staging_buffer(shift + size * 8)[shift:].view(np.float64)
        shared[...] = inputs[comm.rank]
        t.allreduce(shared, ReduceOp.SUM)
        wrong.check(shared, want, "shm in-region allreduce")
        assert ready_barriers() == 1
        for private_ranks in (1, 0):                  # odd ranks private, then even ranks private
            mixed = np.empty(size) if comm.rank % 2 == private_ranks else shared
            mixed[...] = inputs[comm.rank]
            t.allreduce(mixed, ReduceOp.SUM)
            wrong.check(mixed, want, f"shm allreduce, private on ranks {private_ranks}::2, in the region elsewhere")
            assert ready_barriers() == chunks
        wrong.assert_none()
    finally:
        t.close()


@pytest.mark.mpi(min_size=2)
def test_shm_allreduce_out_of_ordinary_memory_into_the_region():
    """allreduce_out(src, dst) with dst in the region and src ordinary memory (a fresh gradient reduced into its
    bucket, an out-of-place result in the window): peers' blocks are copied into dst chunk by chunk (the chunks
    private data runs), this rank's is reduced from src, src untouched -- and, where some ranks' dst is ordinary
    memory, alike."""
    comm = MPI.COMM_WORLD
    wrong = Mismatches()
    t = make_transport("shm", fusion_threshold=1 << 20, stall_timeout_s=20)
    t.private_chunk_bytes = 8192
    t.cache_piece_bytes = 1000
    barriers = []
    real_barrier = t._barrier
    t._barrier = lambda what, **kw: barriers.append(what) or real_barrier(what, **kw)
    try:
        size = 10007
        inputs = rank_inputs(size, "float64", ReduceOp.SUM, 9, comm.size)
        want = reference(inputs, ReduceOp.SUM)
        shift = 64 * comm.rank                        # at an offset that differs between ranks
        dst = t.staging_buffer(shift + size * 8)[shift:].view(np.float64)
        for scale in (1.0, 0.5):
            src = inputs[comm.rank].copy()
            dst[...] = -1.0                           # nothing of dst may be read as input
            barriers.clear()
            t.allreduce_out(src, dst, ReduceOp.SUM, scale)
            wrong.check(dst, want * scale, f"shm allreduce_out into the region, scale {scale}")
            wrong.check(src, inputs[comm.rank].astype(np.float64), "its input")
            assert barriers.count("ready") == len(t._chunks(even_counts(size, comm.size), 8)) > 1, barriers
        for private_ranks in (1, 0):                  # odd ranks' dst private, then even ranks'
            into = np.full(size, -1.0) if comm.rank % 2 == private_ranks else dst
            into[...] = -1.0
            src = inputs[comm.rank].copy()
            t.allreduce_out(src, into, ReduceOp.SUM)
            wrong.check(into, want, f"shm allreduce_out, dst private on ranks {private_ranks}::2, in the region "
                                    "elsewhere")
            wrong.check(src, inputs[comm.rank].astype(np.float64), "its input, mixed")
        wrong.assert_none()
    finally:
        t.close()


@pytest.mark.mpi(min_size=2)
def test_shm_streamed_out_of_place_results_equal_the_ordinary_path_bit_for_bit(monkeypatch):
    """Out-of-place float allreduces whose result is written with non-temporal stores (stream_copy.py; here from
    any size): numpy-equal on small integers, and on random floats bitwise equal to the same transport's ordinary
    path, for float32/float64, Sum with the scales 1 and 1/size, an odd size, chunks and pieces, a result not on a
    vector boundary and one not even on an element boundary (that one takes the ordinary path), in place alongside."""
    from ringtrain import stream_copy
    comm = MPI.COMM_WORLD
    if not stream_copy.available():
        pytest.skip(f"no stream-copy module: {stream_copy.library()}")
    wrong = Mismatches()
    t = make_transport("shm", fusion_threshold=1 << 20, stall_timeout_s=20)
    t.private_chunk_bytes = 32768
    t.cache_piece_bytes = 1000
    streamed = []
    real = stream_copy.reduce_push
    monkeypatch.setattr(stream_copy, "reduce_push", lambda *a: streamed.append(1) or real(*a))
    try:
        for dtype_name in ("float32", "float64"):
            dtype = DTYPES[dtype_name]
            for size in (16411,):
                exact = rank_inputs(size, dtype_name, ReduceOp.SUM, 11, comm.size)
                floats = [np.random.default_rng([12, r, size]).standard_normal(size).astype(dtype)
                          for r in range(comm.size)]
                for scale, shift in ((1.0, 0), (1.0 / comm.size, 1)):
                    results = {}
                    for threshold in (0, 1 << 62):               # streamed, then the ordinary path
                        monkeypatch.setattr(stream_copy, "STREAM_BYTES", threshold)
                        for label, inputs in (("exact", exact), ("floats", floats)):
                            out = np.full(size + 1, -1, dtype)[shift: shift + size]
                            src = inputs[comm.rank].copy()
                            streamed.clear()
                            t.allreduce_out(src, out, ReduceOp.SUM, scale)
                            assert bool(streamed) == (threshold == 0), (threshold, streamed)
                            results[label, threshold] = out.copy()
                            wrong.check(src, inputs[comm.rank].astype(np.float64), "its input")
                    what = f"{dtype_name} {size} scale {scale} shift {shift}"
                    want = (reference(exact, ReduceOp.SUM).astype(dtype) * dtype.type(scale)).astype(np.float64)
                    wrong.check(results["exact", 0], want, f"streamed, {what}")
                    if not np.array_equal(results["floats", 0], results["floats", 1 << 62]):
                        wrong.found.append(f"rank {comm.rank}: {what}: streamed and ordinary float results differ")
            # an element-misaligned result and an in-place call: never streamed, still right
            monkeypatch.setattr(stream_copy, "STREAM_BYTES", 0)
            size = 16411
            exact = rank_inputs(size, dtype_name, ReduceOp.SUM, 13, comm.size)
            want = reference(exact, ReduceOp.SUM)
            odd = np.zeros(size * dtype.itemsize + 1, np.uint8)[1:].view(dtype)
            streamed.clear()
            t.allreduce_out(exact[comm.rank].copy(), odd, ReduceOp.SUM)
            wrong.check(odd, want, f"{dtype_name} element-misaligned result")
            inplace = exact[comm.rank].copy()
            t.allreduce_out(inplace, inplace, ReduceOp.SUM)
            wrong.check(inplace, want, f"{dtype_name} in place")
            assert not streamed
        wrong.assert_none()
    finally:
        t.close()


@pytest.mark.mpi(min_size=2)
def test_shm_rejects_a_communicator_spanning_nodes():
    """Split_type only sees one node here, so emulate two 'nodes' by splitting the world: the shm transport
    must refuse a communicator whose ranks it cannot all map."""
    from ringtrain.errors import TransportError
    from ringtrain.transports.shm import SharedMemoryTransport

    class CommSpanningTwoNodes(MPI.Intracomm):
        def Split_type(self, split_type, key=0, info=MPI.INFO_NULL):
            return self.Split(self.Get_rank() % 2, key)

    comm = CommSpanningTwoNodes(MPI.COMM_WORLD.Dup())
    try:
        with pytest.raises(TransportError, match="one node"):
            SharedMemoryTransport(comm, Config(), Watchdog())
    finally:
        comm.Free()


def _raise_deadline(signum, frame):
    raise TimeoutError("still waiting after 10 s: the abort flag was ignored")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", TRANSPORTS)
def test_wait_raises_rank_failure_when_aborted(name):
    """Rank 0 starts a collective its peers never join, with the engine's abort flag set: it must raise
    RankFailureError at once instead of blocking. Peers are idle, so the job itself cannot hang."""
    comm = MPI.COMM_WORLD
    t = make_transport(name)
    outcome = None
    try:
        if comm.rank == 0:
            t.watchdog.abort_reason = "rank 1 is gone (test)"
            begin = time.monotonic()
            # a deadline on rank 0 only (its wait is a Python polling loop, so the alarm interrupts it): if the
            # abort check were missing, the test fails instead of hanging the job
            previous = signal.signal(signal.SIGALRM, _raise_deadline)
            signal.alarm(10)
            try:
                if name == "shm":
                    t.allreduce(np.ones(100, np.float32), ReduceOp.SUM)
                else:
                    # a receive nobody matches, waited through the ring's own wait primitive; cancelled
                    # afterwards so the communicator is clean
                    request = t.comm.Irecv(np.empty(1, np.float32), source=1, tag=999)
                    try:
                        t.wait([request], "a message from rank 1")
                    finally:
                        request.Cancel()
                        request.Wait()
                outcome = "returned without raising"
            except RankFailureError as error:
                outcome = (error, time.monotonic() - begin)
            except BaseException as error:     # anything else (the deadline too): still reach the bcast below
                outcome = f"raised {error!r}"
            finally:
                signal.alarm(0)
                signal.signal(signal.SIGALRM, previous)
        # decide on every rank, so a failure on rank 0 cannot leave its peers waiting in close()
        outcome = comm.bcast(str(outcome) if not isinstance(outcome, tuple) else
                             (str(outcome[0]), outcome[1]), root=0)
    finally:
        t.close()
    assert isinstance(outcome, tuple), f"rank 0: {name} wait {outcome}"
    message, seconds = outcome
    assert "rank 1 is gone" in message and seconds < 2.0, (message, seconds)


@pytest.mark.mpi(min_size=2)
def test_shm_ranks_disagreeing_on_the_collective_all_raise_and_stay_in_step():
    """If the ranks ever ran different buckets, reducing each other's memory would give garbage silently: every
    rank must raise instead, naming what each rank had, and the transport must keep working afterwards."""
    from ringtrain.errors import TransportError

    comm = MPI.COMM_WORLD
    t = make_transport("shm", stall_timeout_s=10.0)    # a bug here ends in StallError, not a hung job
    try:
        buf = np.ones(10 + (comm.rank == 1), np.float32)
        try:
            t.allreduce(buf, ReduceOp.SUM)
            outcome = "no error"
        except TransportError as error:
            outcome = str(error)
        outcomes = comm.allgather(outcome)
        buf = np.ones(10, np.float32)
        t.allreduce(buf, ReduceOp.SUM)
        still_works = bool((buf == comm.size).all())
    finally:
        t.close()
    for rank, message in enumerate(outcomes):
        assert "rank 0: allreduce of 40 bytes" in message and "rank 1: allreduce of 44 bytes" in message, \
            f"rank {rank}: {message}"
    assert still_works


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("where", ["private", "region"])
def test_shm_large_collectives_that_disagree_all_raise_and_stay_in_step(where):
    """Past the one-barrier path the ranks compare signatures after the first barrier: a rank with a larger buffer,
    or one running a reducescatter where the others allreduce, makes every rank raise, naming what each rank ran,
    and the agreeing collectives after it are right -- for private buffers and for buffers in the region, two of
    them at different offsets used in turn (the transport remembers where the last one lies)."""
    from ringtrain.errors import RingtrainError, TransportError

    comm = MPI.COMM_WORLD
    last = comm.size - 1
    t = make_transport("shm", fusion_threshold=1 << 20, stall_timeout_s=10.0)   # a bug ends in StallError
    n = 40000                                          # 160 KB of float32: past the one-barrier path
    try:
        if where == "region":
            region = t.staging_buffer(3 * n * 4 + 4096).view(np.float32)
            buffers = [region[:n + 16], region[1024 + n:1024 + 2 * n + 16]]
        else:
            buffers = [np.empty(n + 16, np.float32), np.empty(n + 16, np.float32)]
        outcomes, results = [], []
        mismatches = [("larger", lambda b: t.allreduce(b[:n + 16 * (comm.rank == last)], ReduceOp.SUM)),
                      ("reducescatter", lambda b: t.reducescatter(b[:n], even_counts(n, comm.size), ReduceOp.SUM)
                       if comm.rank == last else t.allreduce(b[:n], ReduceOp.SUM))]
        for step, (what, run) in enumerate(mismatches):
            buf = buffers[step % 2]
            buf[...] = 1
            try:
                run(buf)
                outcomes.append((what, "no error"))
            except TransportError as error:
                outcomes.append((what, str(error)))
            for k in range(3):                         # agreeing allreduces after it, the two buffers in turn
                good = buffers[(step + k) % 2][:n]
                good[...] = comm.rank + k
                try:                                   # out of step, ranks stall: every rank must get to the end
                    t.allreduce(good, ReduceOp.SUM)
                    results.append(bool((good == sum(range(comm.size)) + comm.size * k).all()))
                except RingtrainError as error:
                    results.append(f"{what}, agreeing allreduce {k}: {error}")
        everyone = comm.allgather(outcomes)
    finally:
        t.close()
    for rank, theirs in enumerate(everyone):
        for what, message in theirs:
            last_ran = (f"rank {last}: allreduce of {4 * (n + 16)} bytes" if what == "larger"
                        else f"rank {last}: reducescatter of {4 * n} bytes")
            assert f"rank 0: allreduce of {4 * n} bytes" in message and last_ran in message, \
                f"rank {rank}, {what}: {message}"
    assert all(result is True for result in results), results


@pytest.mark.mpi(min_size=2)
def test_shm_rank_that_never_arrives_is_a_stall_error_naming_it():
    from ringtrain.errors import StallError

    comm = MPI.COMM_WORLD
    t = make_transport("shm", stall_timeout_s=0.3)
    outcome = None
    try:
        if comm.rank == 0:
            try:
                t.allreduce(np.ones(8, np.float32), ReduceOp.SUM)     # nobody else joins
                outcome = "returned"
            except StallError as error:
                outcome = str(error)
        outcome = comm.bcast(outcome, root=0)
    finally:
        t.close()
    missing = list(range(1, comm.size))
    assert f"ranks {missing} did not reach shm ready" in outcome, outcome
