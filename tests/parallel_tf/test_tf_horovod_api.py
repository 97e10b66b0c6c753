"""Horovod's horovod.tensorflow names that scripts call, with Horovod's documented behaviour: the *_built queries,
rank_op / size_op / local_rank_op / local_size_op, grouped_allgather, broadcast_global_variables, integer Average,
allreduce of tf.IndexedSlices without dense_shape, and auto names that restart with ringtrain.core.names.reset()."""
import numpy as np
import pytest
import tensorflow as tf

import ringtrain
import ringtrain.tensorflow as hvd
from ringtrain.core import build_info

MODES = ["eager", "graph"]
pytestmark = pytest.mark.mpi(min_size=2)


def run(mode, fn, *args):
    return fn(*args) if mode == "eager" else tf.function(fn)(*args)


def test_built_queries_are_the_core_answers():
    for name in ("mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "cuda_built", "gloo_built",
                 "gloo_enabled", "ddl_built", "ccl_built", "rocm_built"):
        assert getattr(hvd, name)() == getattr(build_info, name)(), name
    assert hvd.mpi_built() and hvd.mpi_enabled() and not hvd.gloo_built() and not hvd.ccl_built()


@pytest.mark.parametrize("mode", MODES)
def test_topology_ops_are_int32_tensors(mode):
    got = run(mode, lambda: [hvd.rank_op(), hvd.size_op(), hvd.local_rank_op(), hvd.local_size_op()])
    assert [t.dtype for t in got] == [tf.int32] * 4
    assert [int(t) for t in got] == [hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size()]


def test_size_op_of_a_process_set():
    evens = hvd.add_process_set(list(range(0, hvd.size(), 2)))
    try:
        assert int(hvd.size_op(process_set_id=evens.process_set_id)) == len(range(0, hvd.size(), 2))
        with pytest.raises(ValueError, match="no process set with id 99"):
            hvd.size_op(process_set_id=99)
    finally:
        hvd.remove_process_set(evens)


@pytest.mark.parametrize("mode", MODES)
def test_grouped_allgather_values_and_gradient(mode):
    n, r = hvd.size(), hvd.rank()
    a = tf.constant(np.full((r + 1, 2), float(r)))            # dim 0 differs by rank
    b = tf.constant(np.arange(3.0) + 10 * r)

    def fn(a, b):
        with tf.GradientTape() as tape:
            tape.watch([a, b])
            ga, gb = hvd.grouped_allgather([a, b], name=f"grouped_allgather.{mode}")
            loss = tf.reduce_sum(ga) * (r + 1.0) + tf.reduce_sum(gb)
        return ga, gb, tape.gradient(loss, [a, b])

    ga, gb, (da, db) = run(mode, fn, a, b)
    np.testing.assert_array_equal(ga.numpy(), np.concatenate([np.full((q + 1, 2), float(q)) for q in range(n)]))
    np.testing.assert_array_equal(gb.numpy(), np.concatenate([np.arange(3.0) + 10 * q for q in range(n)]))
    # Horovod: this rank's rows of the gradient averaged over ranks
    np.testing.assert_allclose(da.numpy(), np.full((r + 1, 2), np.mean([q + 1.0 for q in range(n)])))
    np.testing.assert_allclose(db.numpy(), np.ones(3))


def test_broadcast_global_variables_in_a_graph_and_its_eager_error():
    with pytest.raises(RuntimeError, match="broadcast_variables"):
        hvd.broadcast_global_variables(0)
    root = hvd.size() - 1
    with tf.Graph().as_default():
        v = tf.compat.v1.Variable(np.full(3, float(hvd.rank())), name="global_v")
        assign = hvd.broadcast_global_variables(root)
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            session.run(assign)
            np.testing.assert_array_equal(session.run(v), np.full(3, float(root)))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [tf.int8, tf.int32, tf.int64])
def test_integer_average_rounds_toward_zero(mode, dtype):
    values = [-75, -1, 75, 1, -5, -100]
    mine = tf.constant(values if hvd.rank() == 0 else [0] * len(values), dtype=dtype)
    got = run(mode, lambda t: hvd.allreduce(t, op=hvd.Average, name=f"trunc.{mode}.{dtype.name}"), mine)
    assert got.numpy().tolist() == [int(v / hvd.size()) for v in values]      # -75 / 2 = -37, as Horovod


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", ["allreduce", "grouped_allreduce", "gradients_sparse_as_dense"])
def test_indexed_slices_without_dense_shape_are_gathered(mode, how):
    """Horovod allgathers the values and indices; without a dense_shape there is nothing to densify."""
    from ringtrain.tensorflow.gradients import allreduce_gradients
    n, r = hvd.size(), hvd.rank()

    def fn():
        slices = tf.IndexedSlices(tf.fill([1, 2], float(r)), tf.constant([r], tf.int64))
        name = f"sparse.no_shape.{how}.{mode}"
        if how == "allreduce":
            return hvd.allreduce(slices, op=hvd.Sum, name=name)
        if how == "grouped_allreduce":
            got, dense = hvd.grouped_allreduce([slices, tf.ones(2)], op=hvd.Sum, name=name)
            np.testing.assert_array_equal(dense.numpy(), np.full(2, float(n))) if mode == "eager" else None
            return got
        return allreduce_gradients([slices], name, op=hvd.Sum, sparse_as_dense=True)[0]
    got = run(mode, fn)
    assert isinstance(got, tf.IndexedSlices) and got.dense_shape is None
    np.testing.assert_array_equal(got.values.numpy(), [[float(q)] * 2 for q in range(n)])
    np.testing.assert_array_equal(got.indices.numpy(), list(range(n)))


def test_eager_auto_names_restart_with_names_reset():
    from ringtrain.tensorflow import functions
    ringtrain.core.names.reset()
    first = functions._auto_name("allreduce", None, tf.zeros(1))
    ringtrain.core.names.reset()
    assert functions._auto_name("allreduce", None, tf.zeros(1)) == first == "tf.allreduce.1"
    # and the ranks still agree on them: an unnamed eager allreduce after the reset
    np.testing.assert_array_equal(hvd.allreduce(tf.ones(2), op=hvd.Sum).numpy(), np.full(2, hvd.size()))


def test_lifecycle_topology_and_control_names():
    from ringtrain.errors import UnsupportedOperationError
    n, r = hvd.size(), hvd.rank()
    assert hvd.is_initialized()
    assert (hvd.cross_rank(), hvd.cross_size()) == (ringtrain.cross_rank(), ringtrain.cross_size())
    hvd.barrier()
    assert hvd.broadcast_object({"from": r}, root_rank=n - 1) == {"from": n - 1}
    assert hvd.allgather_object(r * 10) == [q * 10 for q in range(n)]
    last = hvd.join()                     # every rank joins at once: some rank is last, the same everywhere
    assert 0 <= last < n and hvd.allgather_object(last) == [last] * n
    with pytest.raises(UnsupportedOperationError, match="Adasum applies to allreduce"):
        hvd.reducescatter(tf.ones(2), op=hvd.Adasum)
