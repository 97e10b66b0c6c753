"""Every collective x dtype x op x size through the public API, against numpy, on every transport."""
import os

import ml_dtypes
import numpy as np
import pytest

import ringtrain as rt
from ringtrain.ops import DTYPES

pytestmark = pytest.mark.mpi(min_size=2)

OPS = [rt.Sum, rt.Average, rt.Min, rt.Max, rt.Product]
SIZES = [0, 1, 7, 4099]          # 4099 is a prime above one 4 KB segment (segment_bytes=4096 below)
LARGE = 262147                   # prime, about 1 MB of float32


# On pretend nodes (RINGTRAIN_SIMULATE_NODES) "shm" is the hierarchy (shm inside each node, the mpi ring across) and
# "mpi"/"mpi_allreduce" are the same flat transports the one-node jobs run over the same world: only "shm" is new
# there (the agreement across nodes runs under every transport alike)
TRANSPORTS = ["shm"] if os.environ.get("RINGTRAIN_SIMULATE_NODES") else ["shm", "mpi", "mpi_allreduce"]


@pytest.fixture(scope="module", params=TRANSPORTS)
def transport(request):
    """Re-initialise ringtrain on each transport with small segments and fusion so pipelining and chunking run."""
    was = rt.is_initialized()
    rt.shutdown()
    rt.init(transport=request.param, segment_bytes=4096, fusion_threshold=64 << 10)
    yield request.param
    rt.shutdown()
    if was:
        rt.init()


def data(rank, shape, dtype, op, salt):
    """Small integers, so sums are exact even in bfloat16; products stay in {1, 2} (or {0, 1} for bool)."""
    rng = np.random.default_rng([rank, salt])
    if np.dtype(dtype) == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    if op == rt.Product:
        return rng.integers(1, 3, shape).astype(dtype)
    low = 0 if np.dtype(dtype).kind == "u" else -3
    return rng.integers(low, 4, shape).astype(dtype)


def reference(inputs, op, dtype):
    n = len(inputs)
    stack = np.stack([x.astype(np.float64) for x in inputs])
    if op in (rt.Sum, rt.Average):
        ref = stack.sum(0)
    elif op == rt.Min:
        ref = stack.min(0)
    elif op == rt.Max:
        ref = stack.max(0)
    else:
        ref = stack.prod(0)
    if op == rt.Average:
        ref = np.sign(ref) * (np.abs(ref) // n) if np.dtype(dtype).kind in "iu" else ref / n   # toward zero
    return ref.astype(dtype)


def tolerance(dtype, op):
    """Inputs are small integers, so every result but a float Average is exact in every dtype. Average is
    sum * (1/n) in the dtype: exact for n a power of two, else within the rounding of 1/n and of the product."""
    if op != rt.Average or np.dtype(dtype).kind not in "fV":
        return 0.0
    return 2 * float(ml_dtypes.finfo(dtype).eps)


def combos():
    for dtype_name, dtype in DTYPES.items():
        for op in OPS:
            if dtype == np.bool_ and op not in (rt.Min, rt.Max):
                continue
            yield dtype_name, dtype, op


def test_allreduce_every_dtype_op_size(transport):
    r, n = rt.rank(), rt.size()
    handles = []
    for i, (dtype_name, dtype, op) in enumerate(combos()):
        for size in SIZES:
            name = f"ar.{dtype_name}.{op.name}.{size}"
            x = data(r, (size,), dtype, op, i * 100 + size)
            handles.append((name, op, dtype, size, i, rt.allreduce_async(x, op=op, name=name)))
    for name, op, dtype, size, i, h in handles:
        got = h.wait()
        want = reference([data(k, (size,), dtype, op, i * 100 + size) for k in range(n)], op, dtype)
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tolerance(dtype, op),
                                   atol=0, err_msg=f"{name} on {transport}")


@pytest.mark.parametrize("op", [rt.Sum, rt.Average])
@pytest.mark.parametrize("dtype", [np.float32, np.int8, DTYPES["bfloat16"]])
def test_allreduce_large(transport, dtype, op):
    """One large array: the path without pack/unpack, where the 1/N of Average is applied inside the transport."""
    r, n = rt.rank(), rt.size()
    x = data(r, (LARGE,), dtype, op, 7)
    kept = x.copy()
    got = rt.allreduce(x, op=op, name=f"large.{np.dtype(dtype).name}.{op.name}")
    want = reference([data(k, (LARGE,), dtype, op, 7) for k in range(n)], op, dtype)
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tolerance(dtype, op), atol=0)
    np.testing.assert_array_equal(x, kept)          # out of place: the input is left as it was


def test_inplace_and_scales(transport):
    r, n = rt.rank(), rt.size()
    x = np.full((3, 5), r + 1.0, np.float64)
    out = rt.allreduce_async(x, op=rt.Sum, name="inplace", prescale_factor=2.0, postscale_factor=0.5, out=x).wait()
    assert out is x
    np.testing.assert_allclose(x, np.full((3, 5), n * (n + 1) / 2))


def test_grouped_allreduce(transport):
    r, n = rt.rank(), rt.size()
    arrays = [np.full(s, r, np.float32) for s in (1, 5, 0, 1000)]
    outs = rt.grouped_allreduce(arrays, op=rt.Sum, name="group")
    for a, o in zip(arrays, outs):
        np.testing.assert_array_equal(o, np.full(a.shape, n * (n - 1) / 2, np.float32))


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_allgather_uneven_first_dim(transport, dtype_name):
    r, n = rt.rank(), rt.size()
    dtype = DTYPES[dtype_name]
    rows = lambda k: (k * 3) % 5          # includes zero rows on some ranks
    got = rt.allgather(data(r, (rows(r), 3), dtype, rt.Sum, 11), name=f"ag.{dtype_name}")
    want = np.concatenate([data(k, (rows(k), 3), dtype, rt.Sum, 11) for k in range(n)])
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("rows_per_rank", [5, LARGE // 3])
def test_allgather_into_out_in_place_and_not(transport, rows_per_rank):
    """out= is written in place; a rank whose input already is its block of out (a view) gets the same result."""
    r, n = rt.rank(), rt.size()
    rows = lambda k: rows_per_rank + k    # uneven
    want = np.concatenate([data(k, (rows(k), 3), np.float32, rt.Sum, 13) for k in range(n)])
    out = np.full_like(want, -7)
    start = sum(rows(k) for k in range(r))
    mine = out[start:start + rows(r)]
    mine[...] = data(r, (rows(r), 3), np.float32, rt.Sum, 13)
    assert rt.allgather(mine, name=f"ag.inplace.{rows_per_rank}", out=out) is out
    np.testing.assert_array_equal(out, want)
    other = np.full_like(want, -7)
    got = rt.allgather_async(data(r, (rows(r), 3), np.float32, rt.Sum, 13), name=f"ag.out.{rows_per_rank}",
                             out=other).wait()
    assert got is other
    np.testing.assert_array_equal(other, want)


def test_allgather_out_of_the_wrong_shape_fails_on_its_rank_only(transport):
    r, n = rt.rank(), rt.size()
    with pytest.raises(ValueError, match="dtype"):
        rt.allgather(np.zeros((2, 3), np.float32), out=np.zeros((2 * n, 3), np.float64))    # before submitting
    wrong = np.zeros((2 * n + (r == 1), 3), np.float32)
    if r == 1:
        with pytest.raises(ValueError, match="out has shape"):
            rt.allgather(np.full((2, 3), r, np.float32), name="ag.wrong", out=wrong)
    else:
        got = rt.allgather(np.full((2, 3), r, np.float32), name="ag.wrong", out=wrong)
        np.testing.assert_array_equal(got, np.repeat(np.arange(n, dtype=np.float32), 2)[:, None] * np.ones(3))
    np.testing.assert_array_equal(rt.allgather(np.full(1, r, np.int32), name="ag.after"), np.arange(n))


@pytest.mark.parametrize("size", [0, 1, 4099])
def test_broadcast_every_root(transport, size):
    r, n = rt.rank(), rt.size()
    for root in range(n):
        got = rt.broadcast(data(r, (size,), np.float32, rt.Sum, root), root_rank=root, name=f"bc.{size}.{root}")
        np.testing.assert_array_equal(got, data(root, (size,), np.float32, rt.Sum, root))


def test_alltoall_with_splits(transport):
    r, n = rt.rank(), rt.size()
    splits = lambda k: [(k + j) % 3 for j in range(n)]
    send = lambda k: np.concatenate([np.full((s, 2), 100 * k + j, np.int32) for j, s in enumerate(splits(k))])
    got, recv_splits = rt.alltoall(send(r), splits=splits(r), name="a2a")
    assert recv_splits == [splits(k)[r] for k in range(n)]
    want = np.concatenate([np.full((splits(k)[r], 2), 100 * k + r, np.int32) for k in range(n)])
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("op", OPS)
def test_reducescatter(transport, op):
    r, n = rt.rank(), rt.size()
    rows = 2 * n + 1                          # uneven blocks: the first one is larger
    got = rt.reducescatter(data(r, (rows, 3), np.float32, op, 5), op=op, name=f"rs.{op.name}")
    full = reference([data(k, (rows, 3), np.float32, op, 5) for k in range(n)], op, np.float32)
    counts = [rows // n + (1 if k < rows % n else 0) for k in range(n)]
    start = sum(counts[:r])
    np.testing.assert_allclose(got, full[start:start + counts[r]], rtol=1e-6)


def test_reducescatter_larger_than_the_shared_region_leaves_its_input(transport):
    """~1 MB against a 64 KB region: the transport reads the input itself (shm: chunk by chunk) and must not write
    into it."""
    r, n = rt.rank(), rt.size()
    rows = LARGE // 3 + n + 1
    mine = data(r, (rows, 3), np.float32, rt.Sum, 6)
    kept = mine.copy()
    got = rt.reducescatter(mine, op=rt.Average, name="rs.large")
    full = sum(data(k, (rows, 3), np.float32, rt.Sum, 6) for k in range(n)) / n
    counts = [rows // n + (1 if k < rows % n else 0) for k in range(n)]
    start = sum(counts[:r])
    np.testing.assert_allclose(got, full[start:start + counts[r]], rtol=1e-6)
    np.testing.assert_array_equal(mine, kept)


def test_out_of_order_submission_completes(transport):
    r, n = rt.rank(), rt.size()
    names = [f"ooo.{i}" for i in range(12)]
    order = np.random.default_rng(r).permutation(len(names))   # a different order on every rank
    handles = {names[i]: rt.allreduce_async(np.full(4, i, np.int64), op=rt.Sum, name=names[i]) for i in order}
    for i, name in enumerate(names):
        np.testing.assert_array_equal(handles[name].wait(timeout=30), np.full(4, i * n))


def test_objects_and_barrier(transport):
    r, n = rt.rank(), rt.size()
    assert rt.broadcast_object({"from": r, "list": [r] * 3}, root_rank=n - 1) == {"from": n - 1, "list": [n - 1] * 3}
    assert rt.allgather_object(("rank", r)) == [("rank", k) for k in range(n)]
    rt.barrier()


def test_mismatch_reaches_every_rank_and_job_stays_usable(transport):
    r, n = rt.rank(), rt.size()
    with pytest.raises(rt.TensorMismatchError) as err:
        rt.allreduce(np.zeros(3 + (r == 1), np.float32), name="mismatch.shape")
    assert "rank 1 has allreduce shape (4,) float32" in str(err.value)
    with pytest.raises(rt.TensorMismatchError, match="float64"):
        rt.allreduce(np.zeros(2, np.float64 if r == 0 else np.float32), name="mismatch.dtype")
    with pytest.raises(rt.TensorMismatchError) as err:
        rt.broadcast(np.zeros(2), root_rank=r % 2, name="mismatch.root")
    evens = ",".join(str(k) for k in range(0, n, 2))
    odds = ",".join(str(k) for k in range(1, n, 2))
    assert (f"{'rank' if n <= 2 else 'ranks'} {evens} {'has' if n <= 2 else 'have'} broadcast shape (2,) float64 "
            f"root 0" in str(err.value)), str(err.value)
    assert (f"{'rank' if n <= 3 else 'ranks'} {odds} {'has' if n <= 3 else 'have'} broadcast shape (2,) float64 "
            f"root 1" in str(err.value)), str(err.value)
    with pytest.raises(rt.TensorMismatchError) as err:   # scales are part of what ranks must agree on
        rt.allreduce(np.zeros(2), op=rt.Sum, prescale_factor=1.0 + (r == 1), name="mismatch.scales")
    assert "rank 1 has allreduce shape (2,) float64 op Sum scales (2.0, 1.0)" in str(err.value), str(err.value)
    np.testing.assert_array_equal(rt.allreduce(np.full(2, r + 1.0), op=rt.Sum, name="after.mismatch"),
                                  np.full(2, n * (n + 1) / 2))


def test_grouped_mismatch_reaches_every_rank_and_job_stays_usable(transport):
    """A synchronous grouped allreduce takes the one-cycle express path (the arrays reduced where they lie): ranks
    that split the same number of elements differently, or hold a different total, still get the clear error."""
    r, n = rt.rank(), rt.size()
    split = [np.zeros(2 + (r == 1), np.float32), np.zeros(3 - (r == 1), np.float32)]
    with pytest.raises(rt.TensorMismatchError, match="grouped.split") as err:
        rt.grouped_allreduce(split, name="grouped.split")
    assert "rank 1 has allreduce shape (5,) float32 op Average in 2 tensors of 3, 2 elements" in str(err.value), str(err.value)
    with pytest.raises(rt.TensorMismatchError, match="grouped.total"):
        rt.grouped_allreduce([np.zeros(2, np.float32), np.zeros(2 + (r == n - 1), np.float32)], name="grouped.total")
    arrays = [np.full(k + 1, r + 1.0) for k in range(3)]
    results = rt.grouped_allreduce(arrays, op=rt.Sum, outs=arrays, name="grouped.after.mismatch")
    for k, result in enumerate(results):
        assert result is arrays[k]
        np.testing.assert_array_equal(result, np.full(k + 1, n * (n + 1) / 2))


def test_bad_input_is_local_and_clear(transport):
    with pytest.raises(ValueError, match="not C-contiguous"):
        rt.allreduce(np.zeros((4, 4), np.float32)[:, ::2])
    with pytest.raises(rt.UnsupportedDtypeError, match="complex64"):
        rt.allreduce(np.zeros(3, np.complex64))
    with pytest.raises(rt.UnsupportedDtypeError, match="bool"):
        rt.allreduce(np.zeros(3, bool), op=rt.Sum)
    with pytest.raises(ValueError, match="out of range"):
        rt.broadcast(np.zeros(3), root_rank=rt.size())
    with pytest.raises(TypeError, match="numpy or cupy"):
        rt.allreduce([1, 2, 3])
    with pytest.raises(ValueError, match="unknown reduce op"):
        rt.allreduce(np.zeros(3), op="median")
    n = rt.size()
    np.testing.assert_array_equal(rt.allreduce(np.full(2, rt.rank() + 1.0), op=rt.Sum, name="after.bad"),
                                  np.full(2, n * (n + 1) / 2))


@pytest.mark.parametrize("count", [12, 50001])     # the one-barrier path; blocks, chunks and owner-scaled pieces
def test_average_while_ranks_have_joined(transport, count):
    """Rank r stops after N - r steps and joins; the others' Average still divides by the full world size, with
    zeros from the joined ranks (DDP's rule). Checked on every element: a joined rank must make the same transport
    call as the active ones (it once reduced without the scale that block owners apply, leaving its blocks
    unscaled on every rank)."""
    n, r = rt.size(), rt.rank()
    steps = [n - q for q in range(n)]
    for step in range(steps[r]):
        inputs = [data(q, (count,), np.float32, rt.Sum, 100 + step) for q in range(n)]
        active = [q for q in range(n) if step < steps[q]]
        want = sum(inputs[q].astype(np.float64) for q in active) / n
        out = rt.allreduce(inputs[r], op=rt.Average, name=f"join.average.{count}")
        np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6, err_msg=f"rank {r}, step {step}")
        pair = rt.grouped_allreduce([inputs[r], inputs[r][:7]], op=rt.Average, name=f"join.grouped.{count}")
        np.testing.assert_allclose(pair[0], want, rtol=1e-6, atol=1e-6, err_msg=f"rank {r}, step {step}")
        np.testing.assert_allclose(pair[1], want[:7], rtol=1e-6, atol=1e-6, err_msg=f"rank {r}, step {step}")
    assert rt.join() == 0
