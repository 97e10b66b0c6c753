"""ringtrain.jax collectives vs numpy, for every dtype JAX has on CPU, eagerly and under jax.jit."""
import functools
import importlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import ringtrain.jax as hvd
from ringtrain.jax import arrays

allreduce_module = importlib.import_module("ringtrain.jax.allreduce")   # hvd.allreduce is the function

DTYPES = [np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64, np.float16,
          ml_dtypes.bfloat16, np.float32, np.float64, np.complex64, np.complex128]
IDS = [np.dtype(d).name for d in DTYPES]
MODES = ["eager", "jit"]


def rank_array(rank, dtype, rows=5, cols=3):
    """Distinct per rank, exact in every dtype (small values; unsigned ones near the top of their range so Min and
    Max see the high bit)."""
    values = (np.arange(rows * cols).reshape(rows, cols) + 3 * rank) % 7
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return values % 2 == 1
    if dtype.kind == "u" and dtype.itemsize >= 4:
        return np.full(values.shape, np.iinfo(dtype).max, dtype) - (values * (rank + 1) * 1000).astype(dtype)
    if dtype.kind == "c":
        return (values + 1j * (values[::-1] - rank)).astype(dtype)
    return values.astype(dtype)


def averaged(total, n):
    """The core's Average: times 1/n (16-bit floats scaled in float32 and rounded once), not a division."""
    if total.dtype.itemsize == 2:
        return (total.astype(np.float32) * np.float32(1 / n)).astype(total.dtype)
    return total * np.real(total).dtype.type(1 / n)


def run(mode, fn, *args):
    return fn(*args) if mode == "eager" else jax.jit(fn)(*args)


def check(got, expected):
    got = np.asarray(got)
    assert got.dtype == expected.dtype and got.shape == expected.shape, (got.dtype, got.shape, expected.shape)
    np.testing.assert_array_equal(got, expected)


def everyone(dtype, **kw):
    return [rank_array(k, dtype, **kw) for k in range(hvd.size())]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_allreduce_every_dtype_and_op(mode, dtype):
    arrays, r, n = everyone(dtype), hvd.rank(), hvd.size()
    x = jnp.asarray(arrays[r])
    kind = np.dtype(dtype).kind
    if kind == "b":
        check(run(mode, lambda t: hvd.allreduce(t, op=hvd.Max), x), np.logical_or.reduce(arrays))
        check(run(mode, lambda t: hvd.allreduce(t, op=hvd.Min), x), np.logical_and.reduce(arrays))
        return
    total = functools.reduce(np.add, arrays)
    check(run(mode, lambda t: hvd.allreduce(t, op=hvd.Sum), x), total)
    if kind in "iu":
        check(run(mode, hvd.allreduce, x), total // np.dtype(dtype).type(n))
    else:
        check(run(mode, hvd.allreduce, x), averaged(total, n))
    if kind != "c":
        check(run(mode, lambda t: hvd.allreduce(t, op=hvd.Min), x), functools.reduce(np.minimum, arrays))
        check(run(mode, lambda t: hvd.allreduce(t, op=hvd.Max), x), functools.reduce(np.maximum, arrays))
        factors = [(a % 3 + 1).astype(dtype) for a in arrays]
        check(run(mode, lambda t: hvd.allreduce(t, op=hvd.Product), jnp.asarray(factors[r])),
              functools.reduce(np.multiply, factors))
    else:
        with pytest.raises(hvd.UnsupportedDtypeError, match="not defined for complex"):
            run(mode, lambda t: hvd.allreduce(t, op=hvd.Max), x)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_allgather_broadcast_alltoall_every_dtype(mode, dtype):
    r, n = hvd.rank(), hvd.size()
    arrays = everyone(dtype)
    check(run(mode, hvd.allgather, jnp.asarray(arrays[r])), np.concatenate(arrays))
    root = n - 1
    check(run(mode, lambda t: hvd.broadcast(t, root), jnp.asarray(arrays[r])), arrays[root])
    blocks = everyone(dtype, rows=2 * n, cols=2)            # rank k's block j goes to rank j
    check(run(mode, hvd.alltoall, jnp.asarray(blocks[r])),
          np.concatenate([b[2 * r: 2 * r + 2] for b in blocks]))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [d for d in DTYPES if d is not np.bool_], ids=IDS[1:])
def test_reducescatter_every_dtype(mode, dtype):
    r, n = hvd.rank(), hvd.size()
    arrays = everyone(dtype, rows=2 * n + 1)               # uneven: the first block is one row larger
    total = functools.reduce(np.add, arrays)
    starts = np.cumsum([0] + [len(b) for b in np.array_split(total, n)])
    check(run(mode, lambda t: hvd.reducescatter(t, op=hvd.Sum), jnp.asarray(arrays[r])),
          total[starts[r]:starts[r + 1]])


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_compressed_allreduce_comes_back_in_the_callers_dtype(mode, compression):
    """compression casts for the wire only: the result has the input's dtype, and 16-bit-exact inputs sum exactly."""
    r, n = hvd.rank(), hvd.size()
    got = run(mode, lambda t: hvd.allreduce(t, op=hvd.Sum, compression=getattr(hvd.Compression, compression)),
              jnp.asarray(rank_array(r, np.float32)))
    assert got.dtype == jnp.float32
    check(got, functools.reduce(np.add, everyone(np.float32)))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", MODES)
def test_grouped_forms_on_pytrees_of_mixed_dtypes(mode):
    r, n = hvd.rank(), hvd.size()
    tree = {"w": rank_array(r, np.float32), "b": rank_array(r, np.int32, rows=1), "c": rank_array(r, np.uint32)}
    summed = run(mode, lambda t: hvd.grouped_allreduce(t, op=hvd.Sum), jax.tree_util.tree_map(jnp.asarray, tree))
    for key, value in summed.items():
        check(value, functools.reduce(np.add, [rank_array(k, tree[key].dtype, rows=tree[key].shape[0])
                                              for k in range(n)]))
    gathered = run(mode, hvd.grouped_allgather, [jnp.asarray(tree["w"]), jnp.asarray(tree["c"])])
    check(gathered[0], np.concatenate(everyone(np.float32)))
    check(gathered[1], np.concatenate(everyone(np.uint32)))
    blocks = run(mode, lambda t: hvd.grouped_reducescatter(t, op=hvd.Sum),
                 [jnp.asarray(rank_array(r, np.float64, rows=n)), jnp.asarray(rank_array(r, np.int64, rows=2 * n))])
    check(blocks[0], functools.reduce(np.add, everyone(np.float64, rows=n))[r:r + 1])
    check(blocks[1], functools.reduce(np.add, everyone(np.int64, rows=2 * n))[2 * r:2 * r + 2])


@pytest.mark.mpi(min_size=2)
def test_eager_allgather_and_alltoall_take_uneven_rows():
    r, n = hvd.rank(), hvd.size()
    check(hvd.allgather(jnp.asarray(rank_array(r, np.float32, rows=r + 1))),
          np.concatenate([rank_array(k, np.float32, rows=k + 1) for k in range(n)]))
    sends = np.concatenate([np.full((j + 1, 2), 10 * r + j, np.int32) for j in range(n)])   # j+1 rows to rank j
    received, splits = hvd.alltoall(jnp.asarray(sends), splits=[j + 1 for j in range(n)])
    check(received, np.concatenate([np.full((r + 1, 2), 10 * k + r, np.int32) for k in range(n)]))
    np.testing.assert_array_equal(np.asarray(splits), [r + 1] * n)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [np.float32, np.uint32, np.complex64], ids=["float32", "uint32", "complex64"])
def test_allreduce_results_come_back_without_a_copy(dtype):
    """The host side's result buffer is the jax.Array's buffer (DLPack), for plain and wire-viewed dtypes and
    sizes whose default result buffers are not 64-byte aligned."""
    for rows in (16, 4096, 1 << 18):
        x = np.asarray(jnp.asarray(rank_array(hvd.rank(), dtype, rows=rows, cols=1)))
        spec = allreduce_module.AllreduceSpec(f"zero_copy.{np.dtype(dtype).name}.{rows}", hvd.Sum, 1.0, 1.0,
                                              hvd.global_process_set)
        (result,) = allreduce_module._run(x, spec=spec)
        y = arrays.to_jax(result)
        assert y.unsafe_buffer_pointer() == result.ctypes.data, rows
        check(y, functools.reduce(np.add, everyone(dtype, rows=rows, cols=1)))
