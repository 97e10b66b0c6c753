"""hvd.SyncBatchNormalization against Keras's BatchNormalization on the whole batch in one process: ranks with
different batch sizes, the outputs, the moving statistics and the input and weight gradients of the summed loss."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import ringtrain.keras as hvd_keras
import ringtrain.tensorflow as hvd

pytestmark = pytest.mark.mpi(min_size=2)


def _batch(rank):
    rng = np.random.default_rng([5, rank])
    return (rng.standard_normal((3 + rank, 4, 5)) * (rank + 1) + rank).astype(np.float32)   # 3, 4, ... rows


def _weights(rank):
    return np.random.default_rng([6, rank]).standard_normal((3 + rank, 4, 5)).astype(np.float32)




def test_statistics_outputs_and_gradients_are_the_whole_batch_ones():
    n, me = hvd.size(), hvd.rank()
    assert hvd_keras.SyncBatchNormalization is hvd.SyncBatchNormalization
    sync = hvd.SyncBatchNormalization(momentum=0.5)
    whole = keras.layers.BatchNormalization(momentum=0.5)
    x = tf.constant(_batch(me))
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        out = sync(x, training=True)
        loss = tf.reduce_sum(out * _weights(me))
    dx = tape.gradient(loss, x)
    dgamma, dbeta = tape.gradient(loss, [sync.gamma, sync.beta])

    xs = tf.constant(np.concatenate([_batch(r) for r in range(n)]))
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(xs)
        ref = whole(xs, training=True)
        ref_loss = tf.reduce_sum(ref * np.concatenate([_weights(r) for r in range(n)]))
    ref_dx = tape.gradient(ref_loss, xs)
    ref_dgamma, ref_dbeta = tape.gradient(ref_loss, [whole.gamma, whole.beta])

    start = sum(3 + r for r in range(me))
    mine = slice(start, start + 3 + me)
    np.testing.assert_allclose(out.numpy(), ref.numpy()[mine], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(sync.moving_mean.numpy(), whole.moving_mean.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(sync.moving_variance.numpy(), whole.moving_variance.numpy(), rtol=1e-4, atol=1e-5)
    # the input gradient is the whole loss's (every rank's loss depends on every rank's rows through the statistics)
    np.testing.assert_allclose(dx.numpy(), ref_dx.numpy()[mine], rtol=1e-3, atol=1e-4)
    # the weights' local gradients add up over the ranks to the whole batch's
    for local, ref_grad in ((dgamma, ref_dgamma), (dbeta, ref_dbeta)):
        total = hvd.allreduce(local, op=hvd.Sum, name="sync_bn.weight_grad.check")
        np.testing.assert_allclose(total.numpy(), ref_grad.numpy(), rtol=1e-3, atol=1e-4)
    # inference uses the moving statistics, with no collective
    np.testing.assert_allclose(sync(x, training=False).numpy(), whole(x, training=False).numpy(), rtol=1e-5,
                               atol=1e-5)
