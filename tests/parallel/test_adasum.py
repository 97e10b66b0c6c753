"""op=Adasum against a one-process float64 reference of the recursive pairwise rule, on numpy arrays and torch.

Every rank builds every rank's input from a seed, so each can compute the reference itself. At 2 and 4 ranks the
results are checked; at 3 ranks (not a power of two) every rank gets the documented error.
"""
import ml_dtypes
import numpy as np
import pytest
import torch

import ringtrain
import ringtrain.torch as hvd
from ringtrain.core import adasum
from ringtrain.errors import TensorMismatchError, UnsupportedDtypeError, UnsupportedOperationError
from ringtrain.ops import bfloat16

from adasum_reference import reference, tree

pytestmark = pytest.mark.mpi(min_size=2)


@pytest.fixture(params=["stacked", "halving"])
def path(request, monkeypatch):
    """Small inputs take one allreduce of every rank's vector; larger ones vector halving. Both, on every rank."""
    if request.param == "halving":
        monkeypatch.setattr(adasum, "STACKED_BYTES", 0)
    return request.param

DTYPES = [np.float16, bfloat16, np.float32, np.float64]
SHAPES = [(1,), (7,), (13, 3), (0,), (1001,)]          # lengths that do not divide by the rank count, and empty
TOLERANCE = {np.dtype(np.float16): 4e-3, bfloat16: 3e-2, np.dtype(np.float32): 1e-5, np.dtype(np.float64): 1e-12}


def power_of_two():
    n = ringtrain.size()
    return n & (n - 1) == 0


def inputs(rank, dtype, shapes=SHAPES, scale=1.0, seed=0):
    rng = np.random.default_rng([seed, rank])
    return [(rng.standard_normal(s) * scale).astype(dtype) for s in shapes]


def assert_close(got, expect, dtype, what):
    tol = TOLERANCE[np.dtype(dtype)] * max(np.abs(expect).max(initial=0.0), np.finfo(np.float64).tiny)
    err = np.abs(np.asarray(got, np.float64) - expect).max(initial=0.0)
    assert err <= tol, f"{what}: max error {err} > {tol} (rank {ringtrain.rank()})"


def everyone(dtype, **kw):
    return [inputs(r, dtype, **kw) for r in range(ringtrain.size())]


def test_adasum_matches_the_pairwise_rule_fused_and_unfused(path):
    if not power_of_two():
        with pytest.raises(UnsupportedOperationError, match="power-of-two"):
            ringtrain.allreduce(np.ones(3, np.float32), op=ringtrain.Adasum)
        return
    me = ringtrain.rank()
    for dtype in DTYPES:
        expect = reference(everyone(dtype))
        mine = inputs(me, dtype)
        unfused = [ringtrain.allreduce(x, op=ringtrain.Adasum, name=f"adasum.one.{i}") for i, x in enumerate(mine)]
        fused = ringtrain.grouped_allreduce(mine, op="adasum", name="adasum.fused")
        for t, e in enumerate(expect):
            assert unfused[t].dtype == fused[t].dtype == np.dtype(dtype) and fused[t].shape == e.shape
            assert_close(unfused[t], e, dtype, f"{np.dtype(dtype)} tensor {t} unfused")
            assert_close(fused[t], e, dtype, f"{np.dtype(dtype)} tensor {t} fused")
        np.testing.assert_array_equal(mine[2], inputs(me, dtype)[2])      # inputs untouched


def test_orthogonal_vectors_add_and_parallel_vectors_average():
    if not power_of_two():
        return
    n, me = ringtrain.size(), ringtrain.rank()
    for dtype in DTYPES:
        basis = np.eye(n + 3, dtype=dtype)
        np.testing.assert_allclose(ringtrain.allreduce(basis[me] * 3, op="adasum").astype(np.float64),
                                   basis[:n].sum(0) * 3)
        v = np.linspace(-2, 2, 11).astype(dtype)
        got = ringtrain.allreduce(v * (me + 1), op="adasum").astype(np.float64)
        np.testing.assert_allclose(got, v.astype(np.float64) * (n + 1) / 2, rtol=TOLERANCE[np.dtype(dtype)] * 4,
                                   atol=TOLERANCE[np.dtype(dtype)] * 4)
        zero = ringtrain.allreduce(np.zeros(5, dtype) if me else v[:5].copy(), op="adasum")
        np.testing.assert_array_equal(zero, v[:5])          # zero vectors leave the others as they are


def test_tiny_and_huge_magnitudes(path):
    if not power_of_two():
        return
    me = ringtrain.rank()
    for dtype in DTYPES:
        info = ml_dtypes.finfo(dtype)
        for scale in (float(info.tiny) * 4, float(np.sqrt(info.max)) / 4):
            shapes = [(9,), (40,)]
            expect = reference(everyone(dtype, shapes=shapes, scale=scale, seed=1))
            got = ringtrain.grouped_allreduce(inputs(me, dtype, shapes=shapes, scale=scale, seed=1), op="adasum",
                                              name="adasum.magnitudes")
            for t, e in enumerate(expect):
                assert np.isfinite(np.asarray(got[t], np.float64)).all()
                # tiny 16-bit values are subnormal: a few of their ulps
                tol = TOLERANCE[np.dtype(dtype)] * (8 if scale < 1 and np.dtype(dtype).itemsize == 2 else 1)
                assert np.abs(got[t].astype(np.float64) - e).max() <= tol * np.abs(e).max(), (dtype, scale, t)


def test_async_in_any_order_in_place_and_scaled(path):
    if not power_of_two():
        return
    me = ringtrain.rank()
    mine = inputs(me, np.float32)
    expect = reference(everyone(np.float32))
    handles = [ringtrain.allreduce_async(x, op="adasum", prescale_factor=2.0, postscale_factor=0.25) for x in mine]
    order = list(range(len(handles)))
    if me % 2:
        order.reverse()                     # odd ranks wait in the other order
    results = {i: handles[i].wait() for i in order}
    for t, e in enumerate(expect):
        assert_close(results[t], e * 0.5, np.float32, f"async tensor {t}")
    x = mine[4].copy()
    assert ringtrain.allreduce(x, op="adasum", out=x) is x
    assert_close(x, expect[4], np.float32, "in place")


def test_bad_input_is_an_error_on_every_rank_and_the_next_call_works(path):
    with pytest.raises(UnsupportedDtypeError, match="int32"):
        ringtrain.allreduce(np.ones(4, np.int32), op="adasum")
    with pytest.raises(UnsupportedOperationError, match="Adasum"):
        ringtrain.reducescatter(np.ones(4, np.float32), op="adasum")
    with pytest.raises(ValueError, match="out"):
        ringtrain.allreduce(np.ones(4, np.float32), op="adasum", out=np.ones(5, np.float32))
    if power_of_two():
        # the halving path names the element counts, the stacked one each rank's bytes
        with pytest.raises(TensorMismatchError, match=r"rank 0 has (4 elements|.*48\)).*ranks? 1.* (5 elements|52\))"):
            ringtrain.allreduce(np.ones(4 + min(ringtrain.rank(), 1), np.float32), op="adasum", name="adasum.bad")
        np.testing.assert_allclose(ringtrain.allreduce(np.ones(3, np.float32), op="adasum"), np.ones(3))


def test_torch_allreduce_and_its_gradient():
    if not power_of_two():
        with pytest.raises(hvd.UnsupportedOperationError, match="power-of-two"):
            hvd.allreduce(torch.ones(2), op=hvd.Adasum)
        return
    me = ringtrain.rank()
    expect = reference(everyone(np.float32))
    got = hvd.allreduce(torch.from_numpy(inputs(me, np.float32)[4]), op=hvd.Adasum)
    assert_close(got.numpy(), expect[4], np.float32, "torch allreduce")
    t = torch.from_numpy(inputs(me, np.float32)[1]).clone()
    hvd.allreduce_(t, op=hvd.Adasum)
    assert_close(t.numpy(), expect[1], np.float32, "torch allreduce_")
    x = torch.from_numpy(inputs(me, np.float32)[2]).requires_grad_()
    (hvd.allreduce(x, op=hvd.Adasum) * 2).sum().backward()          # the gradient is the Adasum of the gradients
    np.testing.assert_allclose(x.grad.numpy(), np.full(x.shape, 2.0), rtol=1e-6)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))


def _batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, 5, generator=g), torch.randn(6, 1, generator=g)


def test_torch_distributed_optimizer_combines_the_local_steps():
    """Horovod's Adasum optimizer: each rank steps on its own gradients (its own momentum), the deltas are combined
    per tensor, every rank ends at start + Adasum(deltas). Reference: N plain optimizers in one process."""
    if not power_of_two():
        return
    n, me = ringtrain.size(), ringtrain.rank()
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum)
    assert isinstance(opt, torch.optim.SGD)
    local = [_model() for _ in range(n)]                       # rank r's local replica, for the reference
    local_opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in local]
    for step in range(3):
        x, y = _batch(me, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        starts = [p.detach().clone() for p in local[0].parameters()]
        deltas = []
        for r in range(n):
            for p, s in zip(local[r].parameters(), starts):
                p.data.copy_(s)
            xr, yr = _batch(r, step)
            local_opts[r].zero_grad()
            torch.nn.functional.mse_loss(local[r](xr), yr).backward()
            local_opts[r].step()
            deltas.append([(p.detach() - s).numpy().astype(np.float64) for p, s in zip(local[r].parameters(), starts)])
        for t, p_ref in enumerate(zip(*[m.parameters() for m in local])):
            new = starts[t].numpy() + tree([d[t].reshape(-1) for d in deltas]).reshape(starts[t].shape)
            for p in p_ref:
                p.data.copy_(torch.from_numpy(new.astype(np.float32)))
        for p, q in zip(model.parameters(), local[0].parameters()):
            np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(), rtol=1e-5, atol=1e-6)
    with pytest.raises(AssertionError, match="Skipping synchronization"):
        with opt.skip_synchronize():
            pass
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        hvd.DistributedOptimizer(torch.optim.SGD(_model().parameters(), lr=0.1), op=hvd.Adasum,
                                 gradient_predivide_factor=2.0)


def test_adasum_in_a_power_of_two_process_set_of_any_world():
    """The set's size counts, not the world's: ranks 0 and N-1 reduce together (also in a world of 3)."""
    n, me = ringtrain.size(), ringtrain.rank()
    pair = ringtrain.add_process_set([0, n - 1])
    try:
        if pair.included():
            mine = inputs(me, np.float32)
            want = reference([inputs(0, np.float32), inputs(n - 1, np.float32)])
            got = ringtrain.grouped_allreduce(mine, op="adasum", process_set=pair)
            for g, w in zip(got, want):
                assert_close(g, w, np.float32, "process set")
        ringtrain.barrier()
    finally:
        ringtrain.remove_process_set(pair)
