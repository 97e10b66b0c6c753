"""Single-process checks of the TensorFlow/Keras binding that need no second rank (the N-rank tests live in
tests/parallel_tf/, launched by tests/test_parallel_tf.py)."""
import subprocess
import sys

import numpy as np
import pytest

from test_parallel_tf import require_tensorflow


def test_import_ringtrain_and_torch_binding_do_not_import_tensorflow():
    code = ("import sys, ringtrain, ringtrain.torch; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


@pytest.fixture(scope="module")
def tf():
    require_tensorflow()
    import tensorflow
    return tensorflow


def test_xla_decision(tf):
    from ringtrain.keras.xla import decide_jit_compile
    assert decide_jit_compile(False) == (False, None)
    use, warning = decide_jit_compile(True)            # what "auto" resolves to on a GPU machine
    assert use is False and "runs without XLA" in warning


def test_bucket_layout_splits_by_size_and_dtype(tf):
    from ringtrain.reducer.reducer import plan_buckets
    from ringtrain.tensorflow.gradients import gradient_members

    def layout(specs, cap):
        wires = [tf.zeros([nbytes // dtype.size], dtype) for nbytes, dtype in specs]
        return [[m.key for m in bucket] for bucket in plan_buckets(gradient_members(wires), cap, cap)]
    f32, f64 = tf.float32, tf.float64
    assert layout([(4, f32), (4, f32), (4, f32)], 8) == [[0, 1], [2]]
    assert layout([(8, f32), (8, f64), (8, f64)], 100) == [[0], [1, 2]]
    assert layout([(48, f32), (4, f32)], 8) == [[0], [1]]      # an oversized tensor gets its own bucket


def test_compression_round_trip(tf):
    from ringtrain.tensorflow import Compression
    x = tf.constant([1.0, 2.5, -3.25], tf.float32)
    for compressor, wire in ((Compression.fp16, tf.float16), (Compression.bf16, tf.bfloat16)):
        compressed, ctx = compressor.compress(x)
        assert compressed.dtype == wire
        back = compressor.decompress(compressed, ctx)
        assert back.dtype == tf.float32
        np.testing.assert_array_equal(back.numpy(), x.numpy())
    ints = tf.constant([1, 2], tf.int32)
    assert Compression.fp16.compress(ints)[0].dtype == tf.int32


def test_variable_names_drop_keras_counters(tf):
    from ringtrain.tensorflow.functions import variable_name

    class Fake:
        path = "sequential_12/dense_24/kernel"
    assert variable_name(Fake()) == "sequential/dense/kernel"


def test_gpu_dlpack_path_needs_a_gpu(tf):
    if not tf.config.list_physical_devices("GPU"):
        pytest.skip("no GPU visible to TensorFlow: the DLPack-to-cupy path (arrays.to_array on a GPU tensor) "
                    "is only exercised on a machine with one")
    from ringtrain.tensorflow import arrays
    with tf.device("/GPU:0"):
        x = tf.range(8, dtype=tf.float32)
    view = arrays.to_array(x)
    assert type(view).__module__.startswith("cupy")
    np.testing.assert_array_equal(arrays.to_tensor(view * 2).numpy(), np.arange(8) * 2)


def test_one_rank_needs_no_host_call(tf, monkeypatch):
    """On one rank the gradients skip the host call (nothing to exchange), but the scales still apply; on two the
    graph holds the host call (without that half, a shortcut taken everywhere would pass the first)."""
    from ringtrain.tensorflow import gradients

    class Ranks:                                        # a registered set of `count` ranks, as far as it is asked
        def __init__(self, count):
            self.size = lambda: count

    def traced(ranks):
        monkeypatch.setattr(gradients, "route", lambda process_set: None)
        fn = tf.function(lambda g: gradients.allreduce_gradients([g, None], "one", prescale_factor=0.5,
                                                                 postscale_factor=3.0, process_set=Ranks(ranks)))
        graph = fn.get_concrete_function(tf.TensorSpec([3], tf.float32)).graph
        return fn, {op.type for op in graph.get_operations() if "PyFunc" in op.type or op.type == "RingtrainHostCall"}

    fn, host_calls = traced(1)
    assert host_calls == set()
    reduced = fn(tf.constant([1.0, 2.0, 4.0]))
    np.testing.assert_allclose(reduced[0].numpy(), [1.5, 3.0, 6.0])
    assert reduced[1] is None
    _, host_calls = traced(2)
    assert host_calls


def test_host_call_moves_no_bytes(tf):
    """What the binding's one-host-call-per-step design rests on (README, "Where the gap goes"): inside tf.function,
    functions.host_call hands the callback views of TensorFlow's buffers and TensorFlow adopts a 64-byte-aligned
    result without copying it, so the host call costs no copy either way."""
    from ringtrain.tensorflow import arrays, functions
    result = arrays.aligned_empty((256, 256), np.float32)
    result[...] = 7.0
    seen = {}

    def callback(array):
        seen["owns its data"] = array.flags.owndata
        return [result]

    fn = tf.function(lambda x: functions.host_call(callback, [x * 2.0], [(tf.float32, x.shape)], "zero_copy")[0])
    out = fn(tf.ones((256, 256)))
    assert seen["owns its data"] is False
    assert np.from_dlpack(out).ctypes.data == result.ctypes.data
    np.testing.assert_array_equal(out.numpy(), result)


def test_host_view_is_a_read_only_view_of_the_tensor(tf):
    """The eager fast path reads a CPU tensor through host_view: TF's own buffer (no copy), every dtype the core
    takes (bfloat16 too, as ml_dtypes.bfloat16), 0-d as a 0-d array, and never writable (TF tensors are immutable)."""
    import ml_dtypes
    from ringtrain.tensorflow import arrays
    for value, dtype in ((np.arange(12.0).reshape(3, 4), tf.float32), ([1.5, -2.0], tf.bfloat16), (7, tf.int64),
                         ([True, False], tf.bool)):
        t = tf.constant(value, dtype=dtype)
        view = arrays.host_view(t)
        assert type(view) is np.ndarray and view.shape == tuple(t.shape) and not view.flags.writeable
        assert view.dtype == (np.dtype(ml_dtypes.bfloat16) if dtype == tf.bfloat16 else dtype.as_numpy_dtype)
        np.testing.assert_array_equal(view.astype(np.float64), t.numpy().astype(np.float64))
        if view.ndim:
            assert view.ctypes.data == np.from_dlpack(tf.bitcast(t, tf.int16) if dtype == tf.bfloat16
                                                      else t).ctypes.data, "host_view copied"
