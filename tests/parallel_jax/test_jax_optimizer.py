"""DistributedOptimizer on N ranks, each on its shard of the batch, equals one process on the whole batch (optax
SGD with momentum and Adam, several buckets, inside jax.jit); broadcast_variables gives every rank rank 0's
parameters; compression stays close."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import ringtrain.jax as hvd

SHARD = 6                        # rows per rank
STEPS = 4


def init_params(seed):
    # numpy's generator: jax.random's first call compiles its threefry kernels (seconds per rank on shared cores)
    rng = np.random.default_rng(seed)

    def w(*shape):
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * 0.3)

    return {"dense1": {"w": w(10, 16), "b": jnp.zeros(16, jnp.float32)},
            "dense2": {"w": w(16, 8), "b": jnp.zeros(8, jnp.float32)},
            "out": {"w": w(8, 3), "b": jnp.zeros(3, jnp.float32)}}


def loss(params, x, y):
    h = jnp.tanh(x @ params["dense1"]["w"] + params["dense1"]["b"])
    h = jnp.tanh(h @ params["dense2"]["w"] + params["dense2"]["b"])
    return jnp.mean((h @ params["out"]["w"] + params["out"]["b"] - y) ** 2)


def batches(n):
    rng = np.random.default_rng(7)
    return [(rng.standard_normal((n * SHARD, 10)).astype(np.float32),
             rng.standard_normal((n * SHARD, 3)).astype(np.float32)) for _ in range(STEPS)]


def train(tx, params, data, rows):
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, x, y):
        grads = jax.grad(loss)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for x, y in data:
        params, opt_state = step(params, opt_state, x[rows], y[rows])
    return params


OPTIMIZERS = {"sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9), "adam": lambda: optax.adam(0.01)}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_n_ranks_equal_one_process_on_the_whole_batch(name):
    r, n = hvd.rank(), hvd.size()
    data = batches(n)
    start = hvd.broadcast_variables(init_params(seed=r), root_rank=0)     # every rank starts from rank 0's
    tx = hvd.DistributedOptimizer(OPTIMIZERS[name](), bucket_bytes=600)
    got = train(tx, start, data, slice(r * SHARD, (r + 1) * SHARD))
    (reducer,) = tx.reducers.values()
    assert len(reducer.reducer.buckets) >= 3                              # several buckets
    expected = train(OPTIMIZERS[name](), init_params(seed=0), data, slice(None))
    for g, e in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(expected)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=2e-5, atol=2e-6)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_compression_sends_16_bits_and_stays_close(compression):
    r, n = hvd.rank(), hvd.size()
    data = batches(n)
    tx = hvd.DistributedOptimizer(optax.sgd(0.1), compression=getattr(hvd.Compression, compression))
    got = train(tx, init_params(seed=0), data, slice(r * SHARD, (r + 1) * SHARD))
    (reducer,) = tx.reducers.values()
    assert {m.kind[0].itemsize for m in reducer.reducer.members} == {2}
    expected = train(optax.sgd(0.1), init_params(seed=0), data, slice(None))
    for g, e in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(expected)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=0.02, atol=2e-3)


@pytest.mark.mpi(min_size=2)
def test_op_sum_and_predivide_follow_horovods_rule():
    r, n = hvd.rank(), hvd.size()
    grads = {"a": jnp.full(3, float(r + 1), jnp.float32)}
    summed, _ = jax.jit(hvd.DistributedOptimizer(optax.identity(), op=hvd.Sum).update)(grads, optax.EmptyState())
    np.testing.assert_allclose(np.asarray(summed["a"]), np.full(3, n * (n + 1) / 2))
    averaged, _ = hvd.DistributedOptimizer(optax.identity(), gradient_predivide_factor=4.0).update(
        grads, optax.EmptyState())
    np.testing.assert_allclose(np.asarray(averaged["a"]), np.full(3, (n + 1) / 2), rtol=1e-6)


@pytest.mark.mpi(min_size=2)
def test_broadcast_variables_gives_every_rank_the_roots_pytree():
    root = hvd.size() - 1
    tree = {"w": jnp.full((2, 2), float(hvd.rank())), "step": jnp.asarray(hvd.rank(), jnp.int32)}
    got = jax.jit(lambda t: hvd.broadcast_variables(t, root_rank=root))(tree)
    np.testing.assert_array_equal(np.asarray(got["w"]), np.full((2, 2), float(root)))
    assert int(got["step"]) == root


@pytest.mark.mpi(min_size=2)
def test_the_reduction_has_no_jax_effect_unless_ordered():
    """No effect: JAX dispatches the jitted step on its fast path. ordered=True: the ringtrain ordering effect."""
    grads = init_params(seed=0)
    unordered_tx, ordered_tx = hvd.DistributedOptimizer(optax.sgd(0.1)), hvd.DistributedOptimizer(optax.sgd(0.1),
                                                                                                    ordered=True)
    plain = jax.make_jaxpr(unordered_tx.update)(grads, unordered_tx.init(grads))
    ordered = jax.make_jaxpr(ordered_tx.update)(grads, ordered_tx.init(grads))
    assert not plain.effects
    assert {str(e) for e in ordered.effects} == {"RingtrainCollective"}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("ordered", [False, True], ids=["unordered", "ordered"])
def test_a_step_mixing_the_reduction_with_other_collectives_runs_alike_on_every_rank(ordered):
    """The reduction beside two ordered collectives in one jitted step (an averaged loss, a broadcast step count):
    every rank finishes every step (no rank waits on another's different order) with the one-process result."""
    r, n = hvd.rank(), hvd.size()
    data = batches(n)
    rows = slice(r * SHARD, (r + 1) * SHARD)
    tx = hvd.DistributedOptimizer(optax.sgd(0.1, momentum=0.9), bucket_bytes=600, ordered=ordered)

    @jax.jit
    def step(params, opt_state, x, y, count):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        mean_loss = hvd.allreduce(value)
        updates, opt_state = tx.update(grads, opt_state, params)
        count = hvd.broadcast(count + 1, root_rank=n - 1)
        return optax.apply_updates(params, updates), opt_state, mean_loss, count

    params, opt_state, count = init_params(seed=0), tx.init(init_params(seed=0)), jnp.asarray(r, jnp.int32)
    for x, y in data:
        params, opt_state, mean_loss, count = step(params, opt_state, x[rows], y[rows], count)
    expected = train(optax.sgd(0.1, momentum=0.9), init_params(seed=0), data, slice(None))
    for g, e in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(expected)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=2e-5, atol=2e-6)
    assert int(count) == n - 1 + STEPS
