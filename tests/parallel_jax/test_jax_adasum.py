"""op=hvd.Adasum in ringtrain.jax against the one-process reference of the pairwise rule: allreduce and
grouped_allreduce (eager and jitted) and DistributedOptimizer (the gradients combined with Adasum, per tensor,
then the optax update), eager and under jit."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import ringtrain.jax as hvd

from adasum_reference import reference

pytestmark = pytest.mark.mpi(min_size=2)

SHAPES = [(7,), (3, 5), (1,)]


def inputs(rank, seed=0):
    rng = np.random.default_rng([seed, rank])
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


def expected(seed=0):
    return reference([inputs(r, seed) for r in range(hvd.size())])


def power_of_two():
    return hvd.size() & (hvd.size() - 1) == 0


def test_allreduce_and_grouped_eager_and_jitted():
    if not power_of_two():
        with pytest.raises(NotImplementedError, match="power-of-two"):
            hvd.allreduce(jnp.ones(3), op=hvd.Adasum)
        return
    mine = [jnp.asarray(x) for x in inputs(hvd.rank())]
    want = expected()
    eager = [hvd.allreduce(x, op=hvd.Adasum, name=f"jax.adasum.{i}") for i, x in enumerate(mine)]
    jitted = jax.jit(lambda xs: hvd.grouped_allreduce(xs, op=hvd.Adasum, name="jax.adasum.grouped"))(mine)
    for results in (eager, jitted):
        for got, w in zip(results, want):
            np.testing.assert_allclose(np.asarray(got), w, rtol=1e-5, atol=1e-5)
    with pytest.raises(hvd.UnsupportedDtypeError, match="int32"):
        hvd.allreduce(jnp.ones(3, jnp.int32), op=hvd.Adasum)


def test_distributed_optimizer_updates_with_the_adasum_of_gradients():
    if not power_of_two():
        return
    grads = {f"w{i}": jnp.asarray(x) for i, x in enumerate(inputs(hvd.rank(), seed=1))}
    params = {k: jnp.zeros_like(v) for k, v in grads.items()}
    opt = hvd.DistributedOptimizer(optax.sgd(0.5), op=hvd.Adasum)
    state = opt.init(params)
    want = reference([inputs(r, seed=1) for r in range(hvd.size())])
    for update in (opt.update, jax.jit(opt.update)):
        updates, _ = update(grads, state, params)
        for i, w in enumerate(want):
            np.testing.assert_allclose(np.asarray(updates[f"w{i}"]), -0.5 * w, rtol=1e-5, atol=1e-6)
