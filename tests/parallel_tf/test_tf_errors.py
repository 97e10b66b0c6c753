"""Ranks that disagree on a collective (shape, dtype, root) get Horovod's tf.errors.FailedPreconditionError on every
rank, eagerly, in tf.function and in a tf.compat.v1 graph, naming the tensor; eagerly it is also ringtrain's
TensorMismatchError. The next collective works."""
import numpy as np
import pytest
import tensorflow as tf

import ringtrain.tensorflow as hvd
from ringtrain.errors import TensorMismatchError

MODES = ["eager", "function", "v1_graph"]


def run(mode, fn):
    if mode == "eager":
        return fn()
    if mode == "function":
        return tf.function(fn)()
    graph = tf.Graph()
    with graph.as_default():
        out = fn()
        with tf.compat.v1.Session(graph=graph) as session:
            return session.run(out)


def disagreeing(kind, name):
    """A collective whose shape, dtype or root differs on the last rank."""
    odd = hvd.rank() == hvd.size() - 1
    if kind == "shape":
        return lambda: hvd.allreduce(tf.ones([4 if odd else 3]), name=name)
    if kind == "dtype":
        return lambda: hvd.allreduce(tf.ones([3], tf.float64 if odd else tf.float32), name=name)
    return lambda: hvd.broadcast(tf.ones([3]), root_rank=1 if odd else 0, name=name)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["shape", "dtype", "root"])
def test_disagreement_is_failed_precondition_everywhere(mode, kind):
    name = f"errors.{mode}.{kind}"
    with pytest.raises(tf.errors.FailedPreconditionError) as error:
        run(mode, disagreeing(kind, name))
    assert name in str(error.value)
    if mode == "eager":
        assert isinstance(error.value, TensorMismatchError)
    # the job goes on: the next collective is right
    total = run(mode, lambda: hvd.allreduce(tf.constant([float(hvd.rank())]), op=hvd.Sum, name=name + ".after"))
    np.testing.assert_allclose(np.asarray(total), [sum(range(hvd.size()))])
