"""ringtrain.jax's host-call primitive in one process, through both lowerings (the XLA FFI handler and JAX's Python
host callback): collectives inside one jitted function run on the host in program order (the ordering token),
even when their data does not depend on each other, and one whose result is unused still runs. The FFI handler
is built wherever a C++ compiler is present, and where it cannot be built the collectives fall back, with a
warning, to the host callback."""
import shutil
import threading
import warnings

import numpy as np
import pytest

from extras import need

jax = need("jax")
jnp = need("jax.numpy", "jax")
from jax.core import ShapedArray  # noqa: E402

from ringtrain.jax import ffi_build, ffi_target
from ringtrain.jax.host_call import collective_primitive

LOWERINGS = ("ffi", "callback")

ran = []


def _record(*arrays, spec):
    ran.append((spec, threading.get_ident()))
    return [np.asarray(a) + 1 for a in arrays]


recorder_p = collective_primitive("test_recorder", _record, lambda *avals, spec: [ShapedArray(a.shape, a.dtype)
                                                                                   for a in avals])


@pytest.fixture(params=LOWERINGS)
def lowering(request, monkeypatch):
    monkeypatch.setenv("RINGTRAIN_JAX_LOWERING", request.param)
    # an earlier test of this process may have left ringtrain initialized with its own config: read the variable
    monkeypatch.setattr(ffi_target.state, "is_initialized", lambda: False)
    return request.param


def test_independent_collectives_run_in_program_order_on_one_thread(lowering):
    def many(x):
        return sum(recorder_p.bind(x * i, spec=i)[0] for i in range(16))
    for _ in range(3):
        ran.clear()
        out = jax.jit(many)(jnp.ones(100))
        np.testing.assert_array_equal(np.asarray(out), np.full(100, sum(i + 1 for i in range(16))))
        assert [spec for spec, _ in ran] == list(range(16))
        assert len({thread for _, thread in ran}) == 1


def test_a_collective_with_an_unused_result_still_runs_and_eagerly_too(lowering):
    ran.clear()
    jax.block_until_ready(jax.jit(lambda x: (recorder_p.bind(x, spec="unused"), x * 2)[1])(jnp.ones(3)))
    (eager,) = recorder_p.bind(jnp.arange(3.0), spec="eager")
    assert [spec for spec, _ in ran] == ["unused", "eager"]
    np.testing.assert_array_equal(np.asarray(eager), [1.0, 2.0, 3.0])


def _fails(*arrays, spec):
    raise ValueError(f"planted failure in {spec}")


failing_p = collective_primitive("test_failing", _fails, lambda *avals, spec: [ShapedArray(a.shape, a.dtype)
                                                                               for a in avals])


def test_an_error_on_the_host_reaches_the_caller_with_its_type_and_message(lowering):
    with pytest.raises(Exception) as caught:
        jax.block_until_ready(jax.jit(lambda x: failing_p.bind(x, spec="f")[0])(jnp.ones(2)))
    assert "ValueError: planted failure in f" in str(caught.value)


def _into(inputs, outputs, spec):
    for x, out in zip(inputs, outputs):
        assert not x.flags.writeable and out.flags.writeable
        out[...] = x * spec if spec != 1 else x


scaled_p = collective_primitive("test_scaled", lambda *arrays, spec: [a * spec if spec != 1 else a.copy()
                                                                     for a in arrays],
                                lambda *avals, spec: [ShapedArray(a.shape, a.dtype) for a in avals], run_into=_into)


@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.uint8, np.bool_, np.complex64, jnp.bfloat16])
def test_results_written_into_xla_buffers_for_every_shape_and_dtype(lowering, dtype):
    arrays = [jnp.asarray(np.arange(n).reshape(shape) % 3).astype(dtype)
              for n, shape in ((0, (0, 4)), (1, ()), (7, (7,)), (60, (3, 4, 5)))]
    got = jax.jit(lambda *xs: scaled_p.bind(*xs, spec=1))(*arrays)
    for x, g in zip(arrays, got):
        assert g.shape == x.shape and g.dtype == x.dtype
        np.testing.assert_array_equal(np.asarray(g), np.asarray(x))


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler: the FFI handler cannot be built here")
def test_the_ffi_handler_builds_where_a_compiler_is_present():
    library, reason = ffi_build.load()
    assert library is not None, reason
    assert ffi_target.use_ffi("cpu")


def test_a_failed_build_falls_back_to_the_host_callback_with_a_warning(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "false")                       # a compiler that always fails
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))      # so no library built earlier is found
    monkeypatch.setattr(ffi_build, "_loaded", None)
    monkeypatch.setattr(ffi_target, "_state", {})
    # an earlier test of this process may have left ringtrain initialized with its own config: read the variable
    monkeypatch.setattr(ffi_target.state, "is_initialized", lambda: False)
    library, reason = ffi_build.load()
    assert library is None and "exited 1" in reason
    monkeypatch.setenv("RINGTRAIN_JAX_LOWERING", "auto")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = jax.jit(lambda x: scaled_p.bind(x, spec=2.0)[0])(jnp.ones(3))
    np.testing.assert_array_equal(np.asarray(got), [2.0, 2.0, 2.0])
    assert any("could not build its XLA FFI handler" in str(w.message) for w in caught)
    monkeypatch.setenv("RINGTRAIN_JAX_LOWERING", "ffi")
    with pytest.raises(RuntimeError, match="RINGTRAIN_JAX_LOWERING=ffi"):
        jax.jit(lambda x: scaled_p.bind(x, spec=3.0)[0])(jnp.ones(3))


shared_buffers = []


def _double_into(inputs, outputs, spec):
    shared_buffers.append([x.ctypes.data == out.ctypes.data for x, out in zip(inputs, outputs)])
    for x, out in zip(inputs, outputs):
        np.multiply(x, 2, out=out)


doubled_in_place_p = collective_primitive("test_doubled_in_place", lambda *arrays, spec: [a * 2 for a in arrays],
                                          lambda *avals, spec: [ShapedArray(a.shape, a.dtype) for a in avals],
                                          run_into=_double_into, in_place=True)


def test_in_place_results_never_overwrite_an_input_still_in_use(lowering):
    """in_place=True: the outputs take the inputs' buffers, and XLA copies an input that is used again (here: x)."""
    x, y = jnp.arange(6.0), jnp.ones(3)
    shared_buffers.clear()
    doubled, again, other = jax.jit(lambda a, b: (*doubled_in_place_p.bind(a * 1, b, spec=None), a + 0))(x, y)
    np.testing.assert_array_equal(np.asarray(doubled), np.arange(6.0) * 2)
    np.testing.assert_array_equal(np.asarray(again), np.full(3, 2.0))
    np.testing.assert_array_equal(np.asarray(other), np.arange(6.0))
    np.testing.assert_array_equal(np.asarray(y), np.ones(3))          # a jit argument is not donated: untouched
    if lowering == "ffi":                 # the intermediate a * 1 is dead after the call: its buffer is reused
        assert shared_buffers[-1][0], shared_buffers


def test_results_handed_to_jax_are_what_jnp_asarray_makes():
    """arrays.to_jax (XLA's client, directly) gives the array jnp.asarray would -- dtype (float64 canonicalised
    without x64), shape, weak type, placement, values -- usable under jit, and adopts an aligned buffer without a
    copy; an unaligned one is copied."""
    from ringtrain.jax import arrays
    for dtype in ("float32", "bfloat16", "uint8", "complex64", "float64"):
        for shape in ((), (0,), (17, 5)):
            a = arrays.result_empty(shape, np.dtype(jnp.dtype(dtype)))
            a[...] = (np.arange(a.size) % 7).reshape(shape)
            y, want = arrays.to_jax(a), jnp.asarray(a)
            assert (y.dtype, y.shape, y.weak_type, y.committed, y.sharding) == \
                   (want.dtype, want.shape, want.weak_type, want.committed, want.sharding), (dtype, shape)
            np.testing.assert_array_equal(np.asarray(y), np.asarray(want))
            if a.size and y.dtype == a.dtype:
                assert y.unsafe_buffer_pointer() == a.ctypes.data, (dtype, shape)
    y = arrays.to_jax(arrays.result_empty((17, 5), np.float32))
    assert jax.jit(lambda t: t * 0 + 1)(y).sum() == 85
    unaligned = np.arange(9, dtype=np.float32)[1:]
    y = arrays.to_jax(unaligned)
    unaligned[:] = -1                                       # a copy: the caller's later writes do not show
    np.testing.assert_array_equal(np.asarray(y), np.arange(1, 9, dtype=np.float32))


def test_small_results_reach_jax_as_copies_the_numpy_array_may_change_after():
    """arrays.copy_to_jax gives the array jnp.asarray would (dtype, shape, weak type, placement, values) for every
    dtype and for 0-d and empty shapes, one signature after another (its cache is keyed by shape and dtype); the
    numpy array (64-byte aligned here, which XLA could have adopted) is written afterwards and the jax.Array keeps
    the values it was given."""
    from ringtrain.jax import arrays
    made = []
    for shape in ((), (0,), (17, 5)):
        for dtype in ("float32", "bfloat16", "uint8", "int32", "complex64", "bool"):
            a = arrays.aligned_empty(shape, np.dtype(jnp.dtype(dtype)))
            a[...] = (np.arange(a.size) % 7 + 1).reshape(shape).astype(a.dtype)
            y, want = arrays.copy_to_jax(a), jnp.asarray(a)
            assert (y.dtype, y.shape, y.weak_type, y.committed, y.sharding) == \
                   (want.dtype, want.shape, want.weak_type, want.committed, want.sharding), (dtype, shape)
            a[...] = np.zeros((), a.dtype)                    # the caller's array again: written right after
            made.append((y, want, dtype, shape))
    for y, want, dtype, shape in made:
        np.testing.assert_array_equal(np.asarray(y), np.asarray(want), err_msg=f"{dtype} {shape}")
    assert jax.jit(lambda t: t * 0 + 1)(made[-4][0]).sum() == 85
