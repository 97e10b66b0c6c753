"""jax.grad through each collective, under jit, vs Horovod's rules computed in numpy from every rank's cotangent.

Each rank's loss is sum(collective(x) * w_r) with a weight w_r of its own, so the cotangent reaching the collective
on rank r is w_r, and the rules say what x's gradient must be."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ringtrain.jax as hvd


def weight(rank, shape):
    return np.random.default_rng(100 + rank).standard_normal(shape)


def grad_of(collective, x, w):
    return np.asarray(jax.jit(jax.grad(lambda v: jnp.sum(collective(v) * w)))(x))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", ["Sum", "Average"])
def test_allreduce_gradient_is_the_allreduced_cotangent(op):
    r, n = hvd.rank(), hvd.size()
    ws = [weight(k, (4, 3)) for k in range(n)]
    got = grad_of(lambda v: hvd.allreduce(v, op=getattr(hvd, op), postscale_factor=2.0), jnp.ones((4, 3)), ws[r])
    expected = 2.0 * (np.sum(ws, axis=0) if op == "Sum" else np.mean(ws, axis=0))
    np.testing.assert_allclose(got, expected, rtol=1e-12)


@pytest.mark.mpi(min_size=2)
def test_grouped_allreduce_gradient():
    r, n = hvd.rank(), hvd.size()
    ws = [(weight(k, (2,)), weight(k + 50, (3, 2))) for k in range(n)]
    got = jax.jit(jax.grad(lambda t: sum(jnp.sum(a * w) for a, w in zip(hvd.grouped_allreduce(t), ws[r]))))(
        [jnp.ones(2), jnp.ones((3, 2))])
    for i in range(2):
        np.testing.assert_allclose(np.asarray(got[i]), np.mean([w[i] for w in ws], axis=0), rtol=1e-12)


@pytest.mark.mpi(min_size=2)
def test_allgather_gradient_is_this_ranks_rows_of_the_average():
    r, n = hvd.rank(), hvd.size()
    ws = [weight(k, (2 * n, 3)) for k in range(n)]
    got = grad_of(hvd.allgather, jnp.ones((2, 3)), ws[r])
    np.testing.assert_allclose(got, np.mean(ws, axis=0)[2 * r:2 * r + 2], rtol=1e-12)


@pytest.mark.mpi(min_size=2)
def test_broadcast_gradient_is_the_average_on_the_root_and_zero_elsewhere():
    r, n = hvd.rank(), hvd.size()
    root = 1
    ws = [weight(k, (3,)) for k in range(n)]
    got = grad_of(lambda v: hvd.broadcast(v, root), jnp.ones(3), ws[r])
    np.testing.assert_allclose(got, np.mean(ws, axis=0) if r == root else np.zeros(3), rtol=1e-12)


@pytest.mark.mpi(min_size=2)
def test_alltoall_gradient_is_the_reverse_alltoall():
    r, n = hvd.rank(), hvd.size()
    ws = [weight(k, (2 * n, 2)) for k in range(n)]
    got = grad_of(hvd.alltoall, jnp.ones((2 * n, 2)), ws[r])
    # my block j went to rank j, where it is block r of the result: its cotangent is ws[j]'s block r
    np.testing.assert_allclose(got, np.concatenate([ws[j][2 * r:2 * r + 2] for j in range(n)]), rtol=1e-12)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", ["Sum", "Average"])
def test_reducescatter_gradient_is_the_scaled_allgather(op):
    r, n = hvd.rank(), hvd.size()
    rows = 2 * n + 1                               # uneven blocks: rank 0's is one row larger
    blocks = [len(b) for b in np.array_split(np.zeros(rows), n)]
    ws = [weight(k, (blocks[k], 2)) for k in range(n)]
    got = grad_of(lambda v: hvd.reducescatter(v, op=getattr(hvd, op), prescale_factor=3.0), jnp.ones((rows, 2)),
                  ws[r])
    # Horovod's rule (not the mathematical gradient): times the set size for Sum, not divided for Average
    np.testing.assert_allclose(got, np.concatenate(ws) * 3.0 * (n if op == "Sum" else 1), rtol=1e-12)


@pytest.mark.mpi(min_size=2)
def test_min_gradient_is_the_min_of_the_cotangents_as_the_table_says():
    r, n = hvd.rank(), hvd.size()
    ws = [weight(k, (3,)) for k in range(n)]
    got = grad_of(lambda v: hvd.allreduce(v, op=hvd.Min), jnp.ones(3), ws[r])
    np.testing.assert_allclose(got, np.min(ws, axis=0), rtol=1e-12)
