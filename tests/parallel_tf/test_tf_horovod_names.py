"""Horovod's remaining TensorFlow / Keras names, each with Horovod's behaviour against a numpy reference:
hvd.DistributedOptimizer on a Keras optimizer, PartialDistributedGradientTape, keras PartialDistributedOptimizer,
reducescatter's scale factors, grouped_reducescatter, broadcast_object_fn, process_set_included_op,
BroadcastGlobalVariablesHook, BroadcastGlobalVariablesCallback(local_variables=), timelines, mpi_ops faces."""
import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import ringtrain.keras as hvd_keras
import ringtrain.tensorflow as hvd
from ringtrain.errors import UnsupportedOperationError


def mean_rank_plus_one():
    return np.mean([k + 1.0 for k in range(hvd.size())])


@pytest.mark.mpi(min_size=2)
def test_tensorflow_distributed_optimizer_hands_keras_optimizers_to_the_keras_binding():
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(learning_rate=1.0))
    assert isinstance(optimizer, keras.optimizers.SGD)
    variable = keras.Variable(np.zeros(3, np.float32))
    optimizer.apply([tf.fill([3], float(hvd.rank() + 1))], [variable])
    np.testing.assert_allclose(variable.numpy(), -mean_rank_plus_one() * np.ones(3))
    with pytest.raises(UnsupportedOperationError, match="DistributedGradientTape"):
        hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("scale", [True, False])
def test_partial_distributed_gradient_tape_keeps_local_gradients(scale):
    n, r = hvd.size(), hvd.rank()
    shared = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")
    local = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")
    x = tf.fill([1, 2], float(r + 1))
    shared(x), local(x)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(shared(x)) + 2.0 * tf.reduce_sum(local(x))
    tape = hvd.PartialDistributedGradientTape(tape, local_layers=local, scale_local_gradients=scale)
    g_shared, g_local = tape.gradient(loss, [shared.kernel, local.kernel])
    np.testing.assert_allclose(g_shared.numpy(), mean_rank_plus_one() * np.ones((2, 1)))
    np.testing.assert_allclose(g_local.numpy(), 2.0 * (r + 1) / (n if scale else 1) * np.ones((2, 1)))


@pytest.mark.mpi(min_size=2)
def test_keras_partial_distributed_optimizer_keeps_local_gradients():
    n, r = hvd.size(), hvd.rank()
    shared = keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")
    local = keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")
    shared.build((None, 2)), local.build((None, 2))
    optimizer = hvd_keras.PartialDistributedOptimizer(keras.optimizers.SGD(learning_rate=1.0), local_layers=[local])
    grads = [tf.fill([2, 1], float(r + 1)), tf.fill([2, 1], float(r + 1))]
    optimizer.apply(grads, [shared.kernel, local.kernel])
    np.testing.assert_allclose(shared.kernel.numpy(), -mean_rank_plus_one() * np.ones((2, 1)))
    np.testing.assert_allclose(local.kernel.numpy(), -(r + 1.0) / n * np.ones((2, 1)))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", ["eager", "function"])
def test_reducescatter_scale_factors_and_grouped_reducescatter(mode):
    n, r = hvd.size(), hvd.rank()
    rows = 2 * n + 1
    everyone = [np.arange(rows * 2, dtype=np.float64).reshape(rows, 2) + 10 * k for k in range(n)]
    sizes = [rows // n + (1 if k < rows % n else 0) for k in range(n)]
    start = sum(sizes[:r])
    total = np.sum(everyone, axis=0)[start:start + sizes[r]]

    def both(x):
        one = hvd.reducescatter(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0, name=f"names.rs.{mode}")
        group = hvd.grouped_reducescatter([x, 2 * x], op=hvd.Sum, name=f"names.grs.{mode}")
        return one, group
    fn = both if mode == "eager" else tf.function(both)
    one, group = fn(tf.constant(everyone[r]))
    np.testing.assert_allclose(one.numpy(), 1.5 * total)
    np.testing.assert_allclose(group[0].numpy(), total)
    np.testing.assert_allclose(group[1].numpy(), 2 * total)
    with tf.GradientTape() as tape:
        x = tf.constant(everyone[r])
        tape.watch(x)
        y = hvd.reducescatter(x, op=hvd.Sum, prescale_factor=0.5, name=f"names.rs.grad.{mode}")
    # Horovod's rule: allgather of the gradient times the set's size for Sum, times the prescale factor
    np.testing.assert_allclose(tape.gradient(y, x).numpy(), 0.5 * n * np.ones((rows, 2)))


@pytest.mark.mpi(min_size=2)
def test_broadcast_object_fn_and_process_set_included_op():
    r = hvd.rank()
    fn = hvd.broadcast_object_fn(root_rank=hvd.size() - 1, name="names.bofn")
    assert fn({"from": r}) == {"from": hvd.size() - 1}
    assert int(hvd.process_set_included_op(0)) == 1
    first = hvd.add_process_set([0])
    try:
        assert int(hvd.process_set_included_op(first.process_set_id)) == (1 if r == 0 else 0)
    finally:
        hvd.remove_process_set(first)


@pytest.mark.mpi(min_size=2)
def test_broadcast_global_variables_hook():
    graph = tf.Graph()
    with graph.as_default():
        variable = tf.compat.v1.get_variable("hooked", initializer=tf.constant([float(hvd.rank() + 5)] * 3))
        hook = hvd.BroadcastGlobalVariablesHook(root_rank=1)
        with tf.compat.v1.train.MonitoredSession(hooks=[hook]) as session:
            np.testing.assert_allclose(session.run(variable), [6.0] * 3)


@pytest.mark.mpi(min_size=2)
def test_broadcast_callback_leaves_local_variables_alone():
    r = hvd.rank()
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.layers[0].kernel.assign(np.full((2, 1), float(r), np.float32))
    model.layers[0].bias.assign(np.full((1,), float(r), np.float32))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    callback = hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=[model.layers[0].bias])
    callback.set_model(model)
    callback.on_train_begin()
    np.testing.assert_allclose(model.layers[0].kernel.numpy(), np.zeros((2, 1)))
    np.testing.assert_allclose(model.layers[0].bias.numpy(), [float(r)])


@pytest.mark.mpi(min_size=2)
def test_timelines_and_topology_names(tmp_path_factory):
    assert hvd.is_homogeneous() in (True, False) and hvd_keras.is_homogeneous is hvd.is_homogeneous
    path = os.path.join(str(tmp_path_factory.mktemp("timeline")), "timeline.json")
    path = hvd.broadcast_object(path, 0, name="names.timeline.path")
    hvd_keras.start_timeline(path)
    hvd.allreduce(tf.ones([4]), name="names.timeline.allreduce")
    hvd.stop_timeline()
    if hvd.rank() == 0:
        with open(path, encoding="utf-8") as f:
            events = json.load(f)
        assert "names.timeline.allreduce" in json.dumps(events["traceEvents"])


def test_mpi_ops_faces_are_the_same_objects():
    import ringtrain.tensorflow.mpi_ops as tf_mpi_ops
    import ringtrain.torch as hvd_torch
    import ringtrain.torch.mpi_ops as torch_mpi_ops
    for name in ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter", "grouped_reducescatter",
                 "size_op", "process_set_included_op", "start_timeline", "init", "rank"):
        assert getattr(tf_mpi_ops, name) is getattr(hvd, name), name
    for name in ("allreduce_async", "synchronize", "poll", "grouped_allreduce", "reducescatter", "join", "size"):
        assert getattr(torch_mpi_ops, name) is getattr(hvd_torch, name), name


@pytest.mark.mpi(min_size=2)
def test_indexed_slices_with_another_op_is_not_implemented_as_in_horovod():
    slices = tf.IndexedSlices(tf.ones([2, 3]), tf.constant([0, 2]), dense_shape=tf.constant([4, 3]))
    with pytest.raises(NotImplementedError, match="op=Average or Sum"):
        hvd.allreduce(slices, op=hvd.Max, name="names.slices.max")
    summed = hvd.allreduce(slices, op=hvd.Sum, name="names.slices.sum")
    assert summed.values.shape[0] == 2 * hvd.size()


def _aggregation_reference(n, passes, average, calls):
    """Numpy: per call k, rank r's gradients shared = (r+1)(k+1) arange(4), local = (r+1+k) ones(2). Returns per call
    (reduced shared, reduced local of this rank or None when the call does not reduce) and the variables after
    each call under SGD(lr=1), applied only on reducing calls."""
    shared, local = np.zeros(4), np.zeros(2)
    out = []
    sums_s, sums_l = np.zeros(4), np.zeros(2)
    r = hvd.rank()
    for k in range(calls):
        sums_s += np.mean([(q + 1) * (k + 1) * np.arange(4) for q in range(n)], axis=0)
        sums_l += (r + 1 + k) * np.ones(2)
        if (k + 1) % passes == 0:
            g_s, g_l = sums_s / (passes if average else 1), sums_l / n / (passes if average else 1)
            shared, local = shared - g_s, local - g_l
            sums_s, sums_l = np.zeros(4), np.zeros(2)
            out.append((g_s, g_l, shared.copy(), local.copy()))
        else:
            out.append((None, None, shared.copy(), local.copy()))
    return out


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("traced", [False, True])
@pytest.mark.parametrize("average", [False, True])
def test_local_gradient_aggregation_helper_reduces_every_nth_call(average, traced):
    n, r, passes, calls = hvd.size(), hvd.rank(), 3, 7
    shared, unused, local = (tf.Variable(np.zeros(4, np.float32)), tf.Variable(1.0),
                             tf.Variable(np.zeros(2, np.float32)))
    variables = [shared, unused, local]
    optimizer = keras.optimizers.SGD(learning_rate=1.0)
    reduced_names = []

    def allreduce(grads, vars):
        reduced_names.append([v.name for v in vars])
        return [hvd.allreduce(g, op=hvd.Average, name=f"agg.{i}") for i, g in enumerate(grads)]

    helper = hvd.LocalGradientAggregationHelper(
        passes, allreduce, sparse_as_dense=True, average_aggregated_gradients=average, rank=r,
        optimizer_type=hvd.LocalGradientAggregationHelper._OPTIMIZER_TYPE_KERAS)
    helper.register_local_var(local)

    def step(g_shared, g_local):
        grads = helper.compute_gradients([g_shared, None, g_local], variables)
        pairs = [(g, v) for g, v in zip(grads, variables) if g is not None]
        applied = helper.apply_gradients(lambda: optimizer.apply_gradients(pairs), optimizer, pairs)
        return grads[0], grads[1], grads[2], applied
    if traced:
        step = tf.function(step)
    for k, (want_s, want_l, after_s, after_l) in enumerate(_aggregation_reference(n, passes, average, calls)):
        g_s = tf.constant((r + 1) * (k + 1) * np.arange(4, dtype=np.float32))
        g_l = tf.constant((r + 1 + k) * np.ones(2, np.float32))
        got_s, got_none, got_l, applied = step(g_s, g_l)
        assert got_none is None and bool(applied) == (want_s is not None), k
        np.testing.assert_allclose(got_s.numpy(), g_s.numpy() if want_s is None else want_s, rtol=1e-6)
        np.testing.assert_allclose(got_l.numpy(), g_l.numpy() if want_l is None else want_l, rtol=1e-6)
        np.testing.assert_allclose(shared.numpy(), after_s, rtol=1e-6)
        np.testing.assert_allclose(local.numpy(), after_l, rtol=1e-6)
    assert int(optimizer.iterations.numpy()) == calls and unused.numpy() == 1.0
    if not traced:
        assert reduced_names == [[shared.name]] * (calls // passes)      # the local variable is never reduced
    with pytest.raises(ValueError, match="sparse_as_dense"):
        hvd.LocalGradientAggregationHelper(2, allreduce, False, False).compute_gradients(
            [tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0]), tf.constant([3, 2]))], [tf.Variable(tf.zeros([3, 2]))])
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        hvd.LocalGradientAggregationHelper(0, allreduce, False, False)
