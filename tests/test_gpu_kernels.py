"""Each CUDA kernel against numpy, for every op and dtype, odd sizes and misaligned views (GPU only).

The references are plain numpy written out here, not ringtrain.ops (the host path the kernels must agree with,
so a bug shared by both would pass). Kernels compute 16-bit floats in float32 and round once, as numpy's own
float16 and ml_dtypes' bfloat16 ufuncs do, so every comparison is exact.
"""
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)
import numpy as np
import pytest

from ringtrain import gpu
from ringtrain.ops import DTYPES, ReduceOp

pytestmark = pytest.mark.skipif(not gpu.available(), reason="no CUDA device")

SIZES = [1, 7, 8, 33, 1000, 65537]
OPS = [ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT]
KERNEL_DTYPES = [d for d in DTYPES if d != "bool"]


@pytest.fixture(scope="module")
def cp():
    import cupy
    return cupy


@pytest.fixture(scope="module")
def kernels():
    from ringtrain import kernels
    return kernels


def values(n, dtype_name, op, seed):
    rng = np.random.default_rng(seed)
    dt = DTYPES[dtype_name]
    if dtype_name == "bool":
        return rng.integers(0, 2, n).astype(dt)
    if dt.kind == "f":
        v = rng.uniform(0.5, 1.5, n) if op == ReduceOp.PRODUCT else rng.normal(0, 10, n)
        return v.astype(dt)
    if dt.kind == "u":
        return rng.integers(0, 200, n).astype(dt)      # sums and products wrap, as in numpy
    return rng.integers(-100, 100, n).astype(dt)


NUMPY_UFUNCS = {ReduceOp.SUM: np.add, ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum,
                ReduceOp.PRODUCT: np.multiply}


def scaled(x, scale):
    """x * scale in x's dtype: 16-bit floats multiply in float32 (the scale rounded to float32 too) and round once;
    integers divide when scale is exactly 1/k, rounding toward zero (Horovod's integer Average)."""
    if x.dtype.kind in "iu":
        k = round(1.0 / scale)
        assert k * scale == 1.0, "the tests only scale integers by 1/k"
        wide = x.astype(np.int64)
        return (np.sign(wide) * (np.abs(wide) // k)).astype(x.dtype)
    wide = np.float64 if x.dtype == np.float64 else np.float32
    return (x.astype(wide) * wide(scale)).astype(x.dtype)


def to_device(cp, host):
    """Upload through uint8 so that bfloat16 needs nothing from cupy but a view."""
    return cp.asarray(host.view(np.uint8)).view(host.dtype)


def to_host(array):
    return array.view(np.uint8).get().view(array.dtype)


def assert_equal(got, want, what):
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, expected {want.dtype}"
    got64, want64 = got.astype(np.float64), want.astype(np.float64)
    bad = np.flatnonzero(got64 != want64)
    assert bad.size == 0, f"{what}: {bad.size} of {got.size} wrong, first at {bad[0]}: {got[bad[0]]} != {want[bad[0]]}"


@pytest.mark.parametrize("dtype_name", KERNEL_DTYPES + ["bool"])
@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name)
def test_reduce_matches_numpy(cp, kernels, op, dtype_name):
    if dtype_name == "bool" and op not in (ReduceOp.MIN, ReduceOp.MAX):
        pytest.skip("bool reduces only by Min/Max")
    for n in SIZES:
        a, b = values(n + 3, dtype_name, op, [n, 1]), values(n + 3, dtype_name, op, [n, 2])
        # aligned, equally misaligned (the vector body after a scalar head), and unequally misaligned (scalar path)
        for sa, sb in ((slice(0, n), slice(0, n)), (slice(1, n + 1), slice(1, n + 1)), (slice(1, n + 1), slice(0, n))):
            want = NUMPY_UFUNCS[op](a[sa], b[sb])
            da, db = to_device(cp, a), to_device(cp, b)
            kernels.reduce(da[sa], db[sb], op)
            got = to_host(da)
            assert_equal(got[sa], want, f"reduce {op.name} {dtype_name} n={n} {sa} {sb}")
            outside = np.ones(n + 3, bool)
            outside[sa] = False
            assert_equal(got[outside], a[outside], "elements outside the view changed")


@pytest.mark.parametrize("dtype_name", KERNEL_DTYPES)
def test_reduce_with_fused_average_scale(cp, kernels, dtype_name):
    n, nranks = 1001, 3
    a, b = values(n, dtype_name, ReduceOp.SUM, 5), values(n, dtype_name, ReduceOp.SUM, 6)
    da, db = to_device(cp, a), to_device(cp, b)
    kernels.reduce(da, db, ReduceOp.AVERAGE, scale=1.0 / nranks)
    if a.dtype.kind in "iu":
        want = scaled(a + b, 1.0 / nranks)           # the sum wraps in the dtype, then divides toward zero
    else:                                            # the sum is not rounded to the dtype before the scale
        wide = np.float64 if a.dtype == np.float64 else np.float32
        want = ((a.astype(wide) + b.astype(wide)) * wide(1.0 / nranks)).astype(a.dtype)
    assert_equal(to_host(da), want, f"average {dtype_name}")


@pytest.mark.parametrize("dtype_name", ["float32", "float16", "bfloat16", "int8", "int64", "float64"])
def test_pack_unpack_many_tensors_in_one_launch(cp, kernels, dtype_name):
    rng = np.random.default_rng(7)
    sizes = [0, 1, 3, 17, 1000, 4099, 2, 65536 + 5] + list(rng.integers(1, 300, 50))
    host = [values(int(s), dtype_name, ReduceOp.SUM, [i, 3]) for i, s in enumerate(sizes)]
    dev = [to_device(cp, h) for h in host]
    buf = cp.zeros((sum(sizes) + 5) * DTYPES[dtype_name].itemsize, cp.uint8).view(DTYPES[dtype_name])
    # pack at an odd element offset: every tensor lands misaligned relative to the buffer
    assert kernels.pack(dev, buf[1:]) == sum(sizes)
    assert_equal(to_host(buf)[1:1 + sum(sizes)], np.concatenate(host), f"pack {dtype_name}")
    outs = [cp.zeros(h.size * h.itemsize, cp.uint8).view(h.dtype) for h in host]
    kernels.unpack(buf[1:], outs)
    for h, o in zip(host, outs):
        assert_equal(to_host(o), h, f"unpack {dtype_name} n={h.size}")
    kernels.unpack(buf[1:], outs, scale=0.25)
    for h, o in zip(host, outs):
        assert_equal(to_host(o), scaled(h, 0.25), f"unpack scaled {dtype_name} n={h.size}")
    kernels.unpack(buf[1:], outs, scale=1.0 / 3)     # not a power of two: rounding shows
    for h, o in zip(host, outs):
        assert_equal(to_host(o), scaled(h, 1.0 / 3), f"unpack scaled by 1/3 {dtype_name} n={h.size}")


def test_device_ops_zero_fill_and_skip(cp):
    ops = gpu.device_ops()
    a, b = cp.arange(5, dtype=cp.float32), cp.arange(7, dtype=cp.float32) + 10
    staging = cp.full(5 + 4 + 7, -1, dtype=cp.float32)
    assert ops.pack([a, 4, b], staging) == 16
    ops.done_event().synchronize()
    assert staging.get().tolist() == list(range(5)) + [0] * 4 + list(range(10, 17))
    out_a, out_b = cp.zeros(5, cp.float32), cp.zeros(7, cp.float32)
    ops.unpack(staging, [out_a, 4, out_b], scale=0.5)
    ops.done_event().synchronize()
    np.testing.assert_array_equal(out_a.get(), np.arange(5) * 0.5)
    np.testing.assert_array_equal(out_b.get(), (np.arange(7) + 10) * 0.5)


@pytest.mark.parametrize("to", ["float16", "bfloat16"])
def test_casts_round_like_numpy(cp, kernels, to):
    rng = np.random.default_rng(3)
    for n in (1, 5, 4096 + 3):
        x = (rng.normal(0, 100, n + 1)).astype(np.float32)
        dx = cp.asarray(x)
        half = cp.zeros((n + 1) * 2, cp.uint8).view(DTYPES[to])
        for sl in (slice(0, n), slice(1, n + 1)):
            kernels.cast(half[sl], dx[sl], scale=0.5)
            want = (x[sl] * np.float32(0.5)).astype(DTYPES[to])
            assert_equal(to_host(half)[sl], want, f"cast float32->{to} n={n} {sl}")
            back = cp.zeros(n, cp.float32)
            kernels.cast(back, half[sl])
            assert_equal(back.get(), want.astype(np.float32), f"cast {to}->float32 n={n}")
