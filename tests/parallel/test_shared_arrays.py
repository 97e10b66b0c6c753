"""empty_shared(): arrays that live in the shm window and are allreduced where they lie -- against numpy, in place
and out of place, mixed with ordinary arrays on other ranks, several at once, and with the pool used up."""
import numpy as np
import pytest

import ringtrain as rt
from ringtrain.core import state

pytestmark = pytest.mark.mpi(min_size=2)

SIZES = [37, 16 << 10, 300_001, 2 << 20]          # the one-barrier small path, and the two-barrier path


def rank_input(n, rank, dtype=np.float32):
    return ((np.arange(n) * 7 + 3 * rank) % 11 + rank).astype(dtype)


def total(n, dtype=np.float32):
    return sum(rank_input(n, r, np.float64) for r in range(rt.size())).astype(dtype)


def shm_transport():
    transport = state.engine().transports["cpu"]
    return transport if transport.name == "shm" else None


@pytest.mark.parametrize("n", SIZES)
def test_in_place_allreduce_of_a_shared_array(n):
    x = rt.empty_shared(n, np.float32)
    transport = shm_transport()
    if transport is not None:
        assert transport._offset_in_region(x) is not None, "empty_shared() did not come from the window"
    for op, want in ((rt.Sum, total(n)), (rt.Average, total(n) / rt.size())):
        x[:] = rank_input(n, rt.rank())
        result = rt.allreduce(x, op=op, name=f"shared.inplace.{n}", out=x)
        assert result is x
        np.testing.assert_allclose(x, want, rtol=1e-6)


def test_in_place_reaches_the_transport_as_one_buffer(monkeypatch):
    """rt.allreduce(x, out=x) (and the optimizer's in-place buckets) must hand the transport src IS dst: two views
    of one buffer make it copy the whole buffer onto itself before reducing (2 ms a step for a 27 MB model)."""
    transport = state.engine().transports["cpu"]
    seen = []
    original = transport.allreduce_out
    monkeypatch.setattr(transport, "allreduce_out", lambda src, dst, *a: seen.append(src is dst) or
                        original(src, dst, *a))
    n = (4 << 20) // 4 + 3                      # above the agreement's eager limit: the transport runs it
    for kind, x in enumerate((rt.empty_shared(n, np.float32), np.empty(n, np.float32))):
        for _ in range(2):                     # first sighting, then the cached path
            x[:] = rank_input(n, rt.rank())
            rt.allreduce(x, op=rt.Sum, name=f"shared.identity.{kind}", out=x)
            np.testing.assert_allclose(x, total(n), rtol=1e-6)
    assert seen == [True] * 4, seen


@pytest.mark.parametrize("n", SIZES)
def test_out_of_place_leaves_the_shared_input_alone(n):
    x = rt.empty_shared(n, np.float32)
    x[:] = rank_input(n, rt.rank())
    out = rt.allreduce(x, op=rt.Sum, name=f"shared.outofplace.{n}")
    np.testing.assert_array_equal(x, rank_input(n, rt.rank()))
    np.testing.assert_allclose(out, total(n), rtol=1e-6)
    into = rt.empty_shared(n, np.float32)
    rt.allreduce(rank_input(n, rt.rank()), op=rt.Sum, name=f"shared.into.{n}", out=into)
    np.testing.assert_allclose(into, total(n), rtol=1e-6)


@pytest.mark.parametrize("n", SIZES)
def test_shared_on_some_ranks_ordinary_on_others(n):
    x = rt.empty_shared(n, np.float64) if rt.rank() % 2 == 0 else np.empty(n, np.float64)
    x[:] = rank_input(n, rt.rank(), np.float64)
    rt.allreduce(x, op=rt.Sum, name=f"shared.mixed.{n}", out=x)
    np.testing.assert_allclose(x, total(n, np.float64), rtol=1e-12)


def test_several_shared_arrays_in_flight_at_once():
    arrays = [rt.empty_shared(n, np.float32) for n in (1 << 20, 5000, 1 << 18, 99)]
    for _ in range(3):
        for k, a in enumerate(arrays):
            a[:] = rank_input(a.size, rt.rank() + k)
        handles = [rt.allreduce_async(a, op=rt.Sum, name=f"shared.many.{k}", out=a) for k, a in enumerate(arrays)]
        for k, (a, h) in enumerate(zip(arrays, handles)):
            h.wait()
            want = sum(rank_input(a.size, r + k, np.float64) for r in range(rt.size()))
            np.testing.assert_allclose(a, want, rtol=1e-6, err_msg=f"array {k}")


def test_torch_empty_shared_allreduces_in_place():
    torch = pytest.importorskip("torch")
    import ringtrain.torch as hvd
    for dtype in (torch.float32, torch.bfloat16):
        t = hvd.empty_shared(4, 1000, dtype=dtype)
        assert t.shape == (4, 1000) and t.dtype == dtype
        t.copy_(torch.from_numpy(rank_input(4000, rt.rank()).reshape(4, 1000)))
        hvd.allreduce_(t, op=hvd.Sum, name=f"shared.torch.{dtype}")
        np.testing.assert_allclose(t.float().numpy().ravel(), total(4000), rtol=1e-2 if dtype == torch.bfloat16
                                   else 1e-6)


def test_a_used_up_pool_falls_back_to_ordinary_arrays():
    rt.shutdown()
    try:
        rt.init(shared_pool_bytes=1 << 16)
        first, second = rt.empty_shared(10000, np.float32), rt.empty_shared(10000, np.float32)   # 40 KB each
        transport = shm_transport()
        if transport is not None:
            assert transport._offset_in_region(first) is not None
            assert transport._offset_in_region(second) is None, "the second array does not fit a 64 KB pool"
        for k, a in enumerate((first, second)):
            a[:] = rank_input(a.size, rt.rank())
            rt.allreduce(a, op=rt.Sum, name=f"shared.pool.{k}", out=a)
            np.testing.assert_allclose(a, total(a.size), rtol=1e-6)
    finally:
        rt.shutdown()
        rt.init()


def test_a_shared_array_larger_than_the_fusion_threshold_mixed_with_ordinary_ones():
    """Beyond the staging area's size the ranks with ordinary arrays go chunk by chunk: the shared one must too."""
    rt.shutdown()
    try:
        rt.init(fusion_threshold=1 << 20)
        n = 700_001                                            # 2.8 MB of float32: three chunks
        x = rt.empty_shared(n, np.float32) if rt.rank() % 2 == 0 else np.empty(n, np.float32)
        x[:] = rank_input(n, rt.rank())
        rt.allreduce(x, op=rt.Sum, name="shared.chunked", out=x)
        np.testing.assert_allclose(x, total(n), rtol=1e-6)
    finally:
        rt.shutdown()
        rt.init()
