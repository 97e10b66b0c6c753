"""hvd.elastic of ringtrain.tensorflow (Horovod's horovod.tensorflow.elastic) on a plain 2-rank world: what sync()
hands over (lossless: the live state of the rank that completed the most steps; roll-back: rank 0's commit), commit /
restore, run outside an elastic job, bad input. The elastic jobs themselves (workers dying and joining) are tested
through the torch and Keras states, which share ringtrain.elastic's runner and source choice."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import ringtrain.keras as hvd_keras
import ringtrain.tensorflow as hvd
from ringtrain.errors import UnsupportedOperationError

pytestmark = pytest.mark.mpi(min_size=2)


def _train(variables, optimizer, steps, rank):
    for k in range(steps):
        grads = [tf.fill(v.shape, float((rank + 1) * (k + 1))) for v in variables]
        optimizer.apply_gradients(zip(grads, variables))


def _momentum_reference(steps, rank, start):
    """SGD(lr=0.1, momentum=0.9) from `start`, Keras's rule: m = 0.9 m - 0.1 g; v += m."""
    v, m = np.array(start, np.float64), np.zeros_like(start, np.float64)
    for k in range(steps):
        m = 0.9 * m - 0.1 * (rank + 1) * (k + 1)
        v = v + m
    return v, m


def test_tensorflow_state_lossless_sync_takes_the_most_advanced_rank():
    r = hvd.rank()
    variables = [tf.Variable(np.full(3, float(r), np.float32)), tf.Variable(np.full((2, 2), 5.0 + r, np.float32))]
    optimizer = keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)
    state = hvd.elastic.TensorFlowState(variables, optimizer=optimizer, epoch=r, history=[r])
    top = hvd.size() - 1
    _train(variables, optimizer, r + 1, r)                 # the last rank completes the most steps
    assert state.steps_completed() == r + 1
    state.sync()
    want = [_momentum_reference(top + 1, top, np.full(s, start, np.float32))
            for s, start in (((3,), float(top)), ((2, 2), 5.0 + top))]
    for variable, (value, _) in zip(variables, want):
        np.testing.assert_allclose(variable.numpy(), value, rtol=1e-5)
    momenta = [v for v in optimizer.variables if v.shape in ((3,), (2, 2))]
    np.testing.assert_allclose(sorted(float(m.numpy().ravel()[0]) for m in momenta),
                               sorted(float(m.ravel()[0]) for _, m in want), rtol=1e-5)
    assert state.steps_completed() == top + 1 and (state.epoch, state.history) == (top, [top])


def test_tensorflow_state_without_optimizer_syncs_rank_zero_and_rolls_back():
    r = hvd.rank()
    variable = tf.Variable(np.full(4, 10.0 + r, np.float32))
    state = hvd.elastic.TensorFlowState([variable], batch=r)
    assert state.steps_completed() == 0
    state.sync()                                            # everyone counts 0 steps: rank 0's live state
    np.testing.assert_array_equal(variable.numpy(), np.full(4, 10.0))
    assert state.batch == 0
    state.rollback = True                                   # Horovod's mode (run(rollback=True) sets it)
    variable.assign(np.full(4, 1.0 + r, np.float32))
    state.batch = 7
    state.commit()
    variable.assign(np.full(4, -1.0, np.float32))
    state.batch = 9
    state.restore()
    np.testing.assert_array_equal(variable.numpy(), np.full(4, 1.0 + r))
    assert state.batch == 7
    state.sync()                                            # roll-back mode: rank 0's committed state, committed
    variable.assign(np.zeros(4, np.float32))
    state.restore()
    np.testing.assert_array_equal(variable.numpy(), np.full(4, 1.0))


def test_elastic_run_names_and_bad_input():
    assert hvd_keras.elastic.run is hvd.elastic.run
    assert hvd_keras.elastic.TensorFlowKerasState is hvd.elastic.TensorFlowKerasState is hvd_keras.elastic.KerasState
    variable = tf.Variable(np.full(2, float(hvd.rank()), np.float32))
    state = hvd.elastic.ObjectState(seen=hvd.rank())

    @hvd.elastic.run
    def train(state, scale):                                # outside an elastic job: a sync, then one call
        return state.seen * scale
    assert train(state, 3) == 0
    with pytest.raises(UnsupportedOperationError, match="session"):
        hvd.elastic.TensorFlowState([variable], session=object())
    with pytest.raises(ValueError, match="list of tf.Variables"):
        hvd.elastic.TensorFlowState()
    with pytest.raises(TypeError, match=r"variables\[1\]"):
        hvd.elastic.TensorFlowState([variable, np.zeros(2)])
