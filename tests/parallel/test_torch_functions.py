"""ringtrain.torch collectives on N ranks vs a numpy reference (each rank can compute every rank's input)."""
import numpy as np
import pytest
import torch

import ringtrain.torch as hvd


@pytest.fixture(scope="module")
def rt():
    if not hvd.is_initialized():
        hvd.init()
    return hvd


def rank_tensor(rank, shape=(3, 5), dtype=torch.float32):
    step = 0.5 if dtype.is_floating_point else 1      # integers stay exact
    return (torch.arange(int(np.prod(shape)), dtype=torch.float64).reshape(shape) * step + rank).to(dtype)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32])
def test_allreduce_sum_and_average(rt, dtype):
    n = rt.size()
    expected = sum(rank_tensor(r, dtype=dtype).double() for r in range(n))
    got = rt.allreduce(rank_tensor(rt.rank(), dtype=dtype), op=rt.Sum, name=f"t.sum.{dtype}")
    assert got.dtype == dtype
    # inputs and sums are exactly representable in every dtype here (halves below 64): the sum must be exact
    np.testing.assert_array_equal(got.double().numpy(), expected.numpy())
    if dtype.is_floating_point:
        avg = rt.allreduce(rank_tensor(rt.rank(), dtype=dtype), name=f"t.avg.{dtype}")
        # sum / n rounded once to the dtype, give or take the rounding of 1/n itself: within 2 ulp
        ulp = torch.finfo(dtype).eps
        np.testing.assert_allclose(avg.double().numpy(), (expected / n).numpy(), rtol=2 * ulp, atol=0)


@pytest.mark.mpi(min_size=2)
def test_allreduce_in_place_and_non_contiguous(rt):
    n = rt.size()
    t = rank_tensor(rt.rank(), (4, 6), torch.float64)
    column_view = t.t()        # non-contiguous: the result must still land in t's memory
    out = rt.allreduce_(column_view, op=rt.Max, name="t.inplace.max")
    assert out is column_view
    np.testing.assert_array_equal(t.numpy(), rank_tensor(n - 1, (4, 6), torch.float64).numpy())


@pytest.mark.mpi(min_size=2)
def test_allreduce_compression_and_async(rt):
    n = rt.size()
    x = torch.full((100,), float(rt.rank() + 1))
    got = rt.allreduce(x, op=rt.Sum, compression=rt.Compression.fp16, name="t.fp16")
    assert got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), n * (n + 1) / 2)
    handle = rt.allreduce_async(x, op=rt.Min, name="t.async")
    np.testing.assert_array_equal(rt.synchronize(handle).numpy(), 1.0)
    assert rt.poll(handle)


@pytest.mark.mpi(min_size=2)
def test_grouped_allreduce_in_place(rt):
    n = rt.size()
    tensors = [torch.full((k + 1,), float(rt.rank())) for k in range(4)]
    results = rt.grouped_allreduce_(tensors, op=rt.Sum, name="t.grouped")
    assert all(r is t for r, t in zip(results, tensors))
    for t in tensors:
        np.testing.assert_array_equal(t.numpy(), n * (n - 1) / 2)
    inputs = [torch.full((3,), float(rt.rank() + 1)), torch.arange(2, dtype=torch.float64) * (rt.rank() + 1)]
    copies = rt.grouped_allreduce(inputs, name="t.grouped.copy")           # Average, out of place
    mean = (n + 1) / 2                                                      # mean of 1..n
    assert [c.tolist() for c in copies] == [[mean] * 3, [0.0, mean]]
    assert inputs[0].tolist() == [float(rt.rank() + 1)] * 3                 # inputs untouched


@pytest.mark.mpi(min_size=2)
def test_allgather_uneven_dim0(rt):
    n = rt.size()
    mine = torch.full((rt.rank() + 1, 2), rt.rank(), dtype=torch.int64)
    got = rt.allgather(mine, name="t.allgather")
    expected = np.concatenate([np.full((r + 1, 2), r) for r in range(n)])
    np.testing.assert_array_equal(got.numpy(), expected)


@pytest.mark.mpi(min_size=2)
def test_broadcast_copy_and_in_place(rt):
    root = rt.size() - 1
    t = rank_tensor(rt.rank(), dtype=torch.bfloat16)
    got = rt.broadcast(t, root_rank=root, name="t.bcast")
    assert torch.equal(got, rank_tensor(root, dtype=torch.bfloat16))
    assert torch.equal(t, rank_tensor(rt.rank(), dtype=torch.bfloat16))       # input untouched
    rt.broadcast_(t, root_rank=root, name="t.bcast_")
    assert torch.equal(t, rank_tensor(root, dtype=torch.bfloat16))


@pytest.mark.mpi(min_size=2)
def test_alltoall_with_splits(rt):
    n, r = rt.size(), rt.rank()
    splits = [i + 1 for i in range(n)]                 # rank r sends i+1 rows to rank i
    rows = torch.cat([torch.full((i + 1, 2), 100 * r + i) for i in range(n)])
    received, received_splits = rt.alltoall(rows, splits=torch.tensor(splits), name="t.alltoall")
    assert received_splits.tolist() == [r + 1] * n
    expected = np.concatenate([np.full((r + 1, 2), 100 * s + r) for s in range(n)])
    np.testing.assert_array_equal(received.numpy(), expected)


@pytest.mark.mpi(min_size=2)
def test_reducescatter_average(rt):
    n, r = rt.size(), rt.rank()
    rows = 2 * n + 1
    x = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3) * (r + 1)
    got = rt.reducescatter(x, op=rt.Average, name="t.rs")
    full = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3) * (n + 1) / 2
    np.testing.assert_allclose(got.numpy(), np.array_split(full, n)[r], rtol=1e-6)


@pytest.mark.mpi(min_size=2)
def test_objects_and_barrier(rt):
    everyone = rt.allgather_object({"rank": rt.rank()}, name="t.objs")
    assert everyone == [{"rank": r} for r in range(rt.size())]
    assert rt.broadcast_object(("from", rt.rank()), root_rank=1, name="t.obj") == ("from", 1)
    rt.barrier()
