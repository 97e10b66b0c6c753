"""Eager allreduce with no gradient tape recording is the core's synchronous call on a view of the tensor (no
custom_gradient, no host call): numpy-equal for Average and Sum, named and unnamed interleaved, large results held by
the caller never overwritten, and under a GradientTape the differentiable path as before."""
import numpy as np
import pytest
import tensorflow as tf

import ringtrain.tensorflow as hvd
from ringtrain.tensorflow import arrays, functions
from rank_data import data, total
from window_adoption import check_window_results_adopted

pytestmark = pytest.mark.mpi(min_size=2)


@pytest.fixture
def no_differentiable_path(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("eager allreduce with no tape took the custom_gradient path")
    monkeypatch.setattr(functions, "_allreduce_differentiable", refuse)


def test_eager_allreduce_is_the_core_call_and_numpy_equal(no_differentiable_path):
    r, size = hvd.rank(), hvd.size()
    for call in range(3):
        for n in (1, 1000, 300_000):
            x = tf.constant(data(n, call, r))
            np.testing.assert_allclose(hvd.allreduce(x, name=f"tf.eager.{n}").numpy(), total(n, call, size) / size,
                                       rtol=1e-6, err_msg=f"rank {r} Average n={n}")
            np.testing.assert_array_equal(hvd.allreduce(x, op=hvd.Sum).numpy(), total(n, call, size),
                                          err_msg=f"rank {r} unnamed Sum n={n}")
            scaled = hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0, name="tf.eager.scaled")
            np.testing.assert_allclose(scaled.numpy(), total(n, call, size) * 1.5, rtol=1e-6)
    ints = hvd.allreduce(tf.constant([7 + r, -7 - r], dtype=tf.int64))          # Average of integers: truncated
    np.testing.assert_array_equal(ints.numpy(), np.trunc(np.array([1, -1]) * (7 + (size - 1) / 2)).astype(np.int64))
    half = hvd.allreduce(tf.constant(data(5, 0, r)), compression=hvd.Compression.fp16)
    assert half.dtype == tf.float32
    np.testing.assert_allclose(half.numpy(), total(5, 0, size) / size, rtol=1e-3)


def test_large_eager_results_held_by_the_caller_stay_intact(no_differentiable_path):
    r, n = hvd.rank(), 300_000
    held = [hvd.allreduce(tf.constant(data(n, call, r)), op=hvd.Sum, name="tf.eager.held") for call in range(6)]
    for call, y in enumerate(held):
        np.testing.assert_array_equal(y.numpy(), total(n, call, hvd.size()), err_msg=f"rank {r}: result {call} changed")


def test_window_results_are_adopted_without_a_copy_and_stay_intact(no_differentiable_path):
    """4 MB results come from the shm window's two slots: TF adopts them without a copy, and a tensor holding one
    keeps its slot (tests/window_adoption.py)."""
    check_window_results_adopted(lambda a: hvd.allreduce(tf.constant(a), op=hvd.Sum, name="tf.eager.window"),
                                 arrays.host_view, lambda y: y.numpy(), hvd.rank(), hvd.size())


def test_under_a_tape_the_gradient_is_recorded():
    x = tf.Variable(data(6, 0, hvd.rank()))
    with tf.GradientTape() as tape:
        y = hvd.allreduce(x * 1.0, op=hvd.Sum, name="tf.eager.grad")
        loss = tf.reduce_sum(y * tf.range(6, dtype=tf.float32))
    grad = tape.gradient(loss, x)
    np.testing.assert_array_equal(grad.numpy(), hvd.size() * np.arange(6, dtype=np.float32))
    np.testing.assert_array_equal(y.numpy(), total(6, 0, hvd.size()))


def test_a_captured_eager_tensor_in_a_function_is_reduced_by_the_graph():
    """An EagerTensor a tf.function captures is still an EagerTensor while the function traces: its allreduce must
    become the graph's collective (run by every call), not a constant reduced once at trace time."""
    x = tf.constant(data(4, 0, hvd.rank()))
    fn = tf.function(lambda: hvd.allreduce(x, op=hvd.Sum, name="tf.eager.captured"))
    graph = fn.get_concrete_function().graph
    assert any(op.name.startswith("ringtrain_") for op in graph.get_operations()), "reduced while tracing"
    for _ in range(2):
        np.testing.assert_array_equal(fn().numpy(), total(4, 0, hvd.size()))
