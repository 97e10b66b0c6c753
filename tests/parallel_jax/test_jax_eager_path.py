"""Eager allreduce of a concrete array is the core's synchronous call on a view of it (no primitive, custom_vjp or
callback): numpy-equal for Average and Sum, named and unnamed interleaved, large results held by the caller never
overwritten, and under jax.grad / jax.jit the primitive as before."""
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ringtrain.jax as hvd
from rank_data import data, total
from window_adoption import check_window_results_adopted

allreduce_module = importlib.import_module("ringtrain.jax.allreduce")

pytestmark = pytest.mark.mpi(min_size=2)


@pytest.fixture
def no_primitive(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("eager allreduce of a concrete array took the primitive")
    monkeypatch.setattr(allreduce_module, "_allreduce", refuse)


def test_eager_allreduce_is_the_core_call_and_numpy_equal(no_primitive):
    r, size = hvd.rank(), hvd.size()
    for call in range(3):
        for n in (1, 1000, 300_000):
            x = jnp.asarray(data(n, call, r))
            np.testing.assert_allclose(np.asarray(hvd.allreduce(x, name=f"jax.eager.{n}")), total(n, call, size) / size,
                                       rtol=1e-6, err_msg=f"rank {r} Average n={n}")
            np.testing.assert_array_equal(np.asarray(hvd.allreduce(x, op=hvd.Sum)), total(n, call, size),
                                          err_msg=f"rank {r} unnamed Sum n={n}")
            scaled = hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0, name="jax.eager.scaled")
            np.testing.assert_allclose(np.asarray(scaled), total(n, call, size) * 1.5, rtol=1e-6)
    unsigned = hvd.allreduce(jnp.asarray(np.array([10 + r, 3], np.uint32)))        # Average as floor of the Sum
    assert unsigned.dtype == jnp.uint32
    np.testing.assert_array_equal(np.asarray(unsigned), (np.array([10 * size + size * (size - 1) // 2, 3 * size])
                                                         // size).astype(np.uint32))
    listed = hvd.allreduce([1.0 + r, 2.0], op=hvd.Sum)                               # not a jax.Array yet
    np.testing.assert_allclose(np.asarray(listed), [size + size * (size - 1) / 2, 2.0 * size])


def test_eager_results_held_by_the_caller_stay_intact(no_primitive):
    """Small results (copies XLA makes) and large ones (the core's pooled buffers, adopted), several of each held
    while later calls of the same name run."""
    r = hvd.rank()
    for n in (1000, 300_000):
        held = [hvd.allreduce(jnp.asarray(data(n, call, r)), op=hvd.Sum, name=f"jax.eager.held.{n}")
                for call in range(6)]
        for call, y in enumerate(held):
            np.testing.assert_array_equal(np.asarray(y), total(n, call, hvd.size()),
                                          err_msg=f"rank {r}: result {call} of {n} changed")


def test_window_results_are_adopted_without_a_copy_and_stay_intact(no_primitive):
    """4 MB results come from the shm window's two slots: XLA adopts them without a copy, and an array holding one
    keeps its slot (tests/window_adoption.py)."""
    check_window_results_adopted(lambda a: hvd.allreduce(jnp.asarray(a), op=hvd.Sum, name="jax.eager.window"),
                                 np.asarray, np.asarray, hvd.rank(), hvd.size())


def test_traced_calls_still_take_the_primitive():
    x = jnp.asarray(data(6, 0, hvd.rank()))
    grad = jax.grad(lambda t: jnp.sum(hvd.allreduce(t, op=hvd.Sum, name="jax.eager.grad") * jnp.arange(6.0)))(x)
    np.testing.assert_array_equal(np.asarray(grad), hvd.size() * np.arange(6.0, dtype=np.float32))
    jitted = jax.jit(lambda t: hvd.allreduce(t, op=hvd.Sum, name="jax.eager.jit"))(x)
    np.testing.assert_array_equal(np.asarray(jitted), total(6, 0, hvd.size()))
