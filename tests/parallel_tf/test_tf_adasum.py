"""op=hvd.Adasum in ringtrain.tensorflow and ringtrain.keras against the one-process reference of the pairwise rule:
allreduce (eager and tf.function), grouped_allreduce, DistributedGradientTape and the Keras DistributedOptimizer
(Horovod's: the gradients are combined with Adasum, then the optimizer steps)."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import ringtrain.keras as hvd_keras
import ringtrain.tensorflow as hvd

from adasum_reference import reference

pytestmark = pytest.mark.mpi(min_size=2)

SHAPES = [(7,), (3, 5), (1,)]


def power_of_two():
    return hvd.size() & (hvd.size() - 1) == 0


def inputs(rank, shapes=SHAPES, seed=0):
    rng = np.random.default_rng([seed, rank])
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def expected(shapes=SHAPES, seed=0):
    return reference([inputs(r, shapes, seed) for r in range(hvd.size())])


def test_allreduce_eager_in_a_function_and_grouped():
    if not power_of_two():
        with pytest.raises(NotImplementedError, match="power-of-two"):
            hvd.allreduce(tf.ones(3), op=hvd.Adasum)
        return
    mine = [tf.constant(x) for x in inputs(hvd.rank())]
    want = expected()
    eager = [hvd.allreduce(x, op=hvd.Adasum, name=f"tf.adasum.{i}") for i, x in enumerate(mine)]

    @tf.function
    def grouped(xs):
        return hvd.grouped_allreduce(xs, op=hvd.Adasum, name="tf.adasum.grouped")
    for results in (eager, grouped(mine), grouped(mine)):
        for got, w in zip(results, want):
            np.testing.assert_allclose(got.numpy(), w, rtol=1e-5, atol=1e-5)
    with pytest.raises(NotImplementedError, match="Adasum applies to allreduce"):
        hvd.reducescatter(tf.ones(4), op=hvd.Adasum)


def _variables():
    return [tf.Variable(np.linspace(-1, 1, int(np.prod(s))).reshape(s).astype(np.float32)) for s in SHAPES]


def _local_gradients(rank, variables):
    """d/dv sum(x_r * v^2) = 2 x_r v: different directions on each rank."""
    return [2 * x * v.numpy() for x, v in zip(inputs(rank, seed=1), variables)]


def test_distributed_gradient_tape_combines_gradients_with_adasum():
    if not power_of_two():
        return
    variables = _variables()
    with tf.GradientTape() as tape:
        loss = tf.add_n([tf.reduce_sum(tf.constant(x) * v * v) for x, v in zip(inputs(hvd.rank(), seed=1), variables)])
    tape = hvd.DistributedGradientTape(tape, op=hvd.Adasum)
    grads = tape.gradient(loss, variables)
    want = reference([_local_gradients(r, variables) for r in range(hvd.size())])
    for g, w in zip(grads, want):
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-5, atol=1e-6)


def test_keras_distributed_optimizer_steps_on_the_adasum_of_gradients():
    if not power_of_two():
        return
    variables = _variables()
    start = [v.numpy().copy() for v in variables]
    opt = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(learning_rate=0.5), op=hvd.Adasum)
    grads = [tf.constant(g) for g in _local_gradients(hvd.rank(), variables)]
    opt.apply_gradients(zip(grads, variables))
    want = reference([_local_gradients(r, [tf.Variable(s) for s in start]) for r in range(hvd.size())])
    for v, s, w in zip(variables, start, want):
        np.testing.assert_allclose(v.numpy(), s - 0.5 * w, rtol=1e-5, atol=1e-6)
    # through hvd.tensorflow's name for it, as Horovod's TF2 scripts call it
    assert isinstance(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Adasum), keras.optimizers.SGD)
