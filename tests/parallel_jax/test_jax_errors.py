"""A collective whose shape differs on one rank fails on every rank with the engine's message naming the ranks and
shapes -- eagerly and under jax.jit -- and the next collective still works."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ringtrain.jax as hvd


def mismatch_message():
    last = hvd.size() - 1
    return re.compile(rf"rank 0 has shape \(5, 3\).*rank {last} has \(5, 4\)|rank {last} has .*\(5, 4\)", re.S)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_mismatched_shape_fails_on_every_rank_then_the_job_goes_on(mode):
    cols = 4 if hvd.rank() == hvd.size() - 1 else 3
    x = jnp.ones((5, cols), jnp.float32)
    fn = (lambda t: hvd.allreduce(t, name=f"mismatch.{mode}")) if mode == "eager" else \
        jax.jit(lambda t: hvd.allreduce(t))
    with pytest.raises(Exception) as caught:
        jax.block_until_ready(fn(x))
    text = str(caught.value)
    assert "TensorMismatchError" in text or isinstance(caught.value, hvd.TensorMismatchError), text
    assert re.search(r"\(5, 3\)", text) and re.search(r"\(5, 4\)", text), text
    assert re.search(r"rank \d", text), text
    ok = jax.jit(lambda t: hvd.allreduce(t, op=hvd.Sum))(jnp.ones(3, jnp.float32))
    np.testing.assert_array_equal(np.asarray(ok), np.full(3, hvd.size(), np.float32))


@pytest.mark.mpi(min_size=2)
def test_jit_allgather_with_different_rows_fails_on_every_rank():
    x = jnp.ones((2 + (hvd.rank() == 0), 3), jnp.float32)
    with pytest.raises(Exception, match=r"every rank's dim 0 must match.*rank 0 has \[3\]"):
        jax.block_until_ready(jax.jit(hvd.allgather)(x))
    np.testing.assert_array_equal(np.asarray(hvd.allreduce(jnp.ones(2), op=hvd.Sum)), [hvd.size()] * 2)


@pytest.mark.mpi(min_size=2)
def test_bad_roots_are_refused_at_the_call_on_every_rank_then_the_job_goes_on():
    """root_rank outside 0..size-1, or not an int, is the caller's mistake: every rank raises at the call (nothing
    reaches the engine), and the next collective works."""
    for root in (-1, hvd.size()):
        with pytest.raises(ValueError, match=rf"root_rank {root} is out of range for {hvd.size()} ranks"):
            hvd.broadcast(jnp.ones(2), root_rank=root)
    with pytest.raises(TypeError, match="root_rank must be an int"):
        hvd.broadcast(jnp.ones(2), root_rank=True)
    got = hvd.broadcast(jnp.full(2, float(hvd.rank())), root_rank=hvd.size() - 1)
    np.testing.assert_array_equal(np.asarray(got), np.full(2, hvd.size() - 1, np.float32))
