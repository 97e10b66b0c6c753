"""The asynchronous TF op (csrc/tf_host_call.cc) that runs ringtrain's collectives in graphs and tf.function.

    outputs = host_op.call(fn, inputs, out_dtypes, name)    # None when the op cannot be built (see `why_not()`)

`fn(*arrays) -> list of arrays` is the collective as a plain synchronous function on numpy views of the inputs.
The op's kernel is an AsyncOpKernel: it hands the inputs to `_start` (under the GIL) and returns TF's executor
thread at once; `fn` runs on a thread of ringtrain's own (one per collective in flight, reused), and its results go
back to TF without a copy where they are 64-byte aligned (TF adopts the buffer and lets it go when the tensor dies),
else copied into an output TF allocates. So no collective ever holds one of TF's threads while other ranks have
not arrived: independent collectives may run in any order on each rank, as with Horovod's AsyncOpKernel ops.

The op is stateful (never constant-folded, never merged with an identical one, always run) but order-insensitive:
tf.function's automatic control dependencies do not chain it after the function's other stateful ops (as TF's own
collective ops), so a function's independent collectives do not wait on one another either.

Errors: a rank disagreement (shape, dtype, op, root: TensorMismatchError) becomes tf.errors.FailedPreconditionError
as in Horovod; bad local input (ValueError, TypeError) InvalidArgumentError; anything else UnknownError carrying the
error's type and message.

Built on first use with the host's C++ compiler ($CXX, else c++) against tf.sysconfig's headers into ringtrain's
per-user cache (ringtrain.csrc.cache_dir), under a name that hashes the source, the TF version and the command, so
a TF upgrade builds afresh. Where it cannot be built (no compiler), graphs fall back to tf.numpy_function with one
warning: correct for collectives created in the same order on every rank, but not deadlock-free.
"""
import atexit
import ctypes
import itertools
import os
import queue
import shlex
import threading
import warnings

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import auto_control_deps

from ringtrain import csrc
from ringtrain.errors import TensorMismatchError

from .arrays import TF_ALIGNMENT

SOURCE = "tf_host_call.cc"
OP_TYPE = "RingtrainHostCall"
_lock = threading.Lock()
_loaded = None            # (ops module, ctypes library) or (None, reason) once tried

# TF status codes (absl::StatusCode)
_OK, _UNKNOWN, _INVALID_ARGUMENT, _FAILED_PRECONDITION = 0, 2, 3, 9

_calls = []               # call id (the op's "call" attribute) -> (fn, out_dtypes, name)
_kept = {}                # keep id -> array whose buffer a TF tensor adopted
_keep_ids = itertools.count(1)


def compiler_command():
    return (shlex.split(os.environ.get("CXX", "c++")) + ["-O2", "-w", "-shared", "-fPIC"]
            + tf.sysconfig.get_compile_flags() + tf.sysconfig.get_link_flags())


def _load():
    target = csrc.built(SOURCE, compiler_command(), key=[tf.__version__])
    module = tf.load_op_library(target)
    library = ctypes.CDLL(target)
    library.ringtrain_tf_output.restype = ctypes.c_void_p
    library.ringtrain_tf_output.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                            ctypes.POINTER(ctypes.c_int64), ctypes.c_char_p, ctypes.c_int64]
    library.ringtrain_tf_adopt_output.restype = None
    library.ringtrain_tf_adopt_output.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                                  ctypes.POINTER(ctypes.c_int64), ctypes.c_void_p, ctypes.c_int64,
                                                  ctypes.c_int64]
    library.ringtrain_tf_finish.restype = None
    library.ringtrain_tf_finish.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_char_p]
    library.ringtrain_tf_set_start(_START)
    library.ringtrain_tf_set_release(_RELEASE)
    # order-insensitive but must run: tf.function runs it without chaining it to the other stateful ops
    auto_control_deps.MUST_RUN_ORDER_INSENSITIVE_STATEFUL_OPS = (
        auto_control_deps.MUST_RUN_ORDER_INSENSITIVE_STATEFUL_OPS | {OP_TYPE})
    return module, library


def load():
    """(ops module, ctypes library), or (None, why the op could not be built or loaded)."""
    global _loaded
    with _lock:
        if _loaded is None:
            try:
                _loaded = _load()
            except Exception as e:     # no compiler, no headers, read-only home: graphs fall back, loudly
                _loaded = (None, f"{type(e).__name__}: {e}")
                warnings.warn(f"ringtrain.tensorflow: the asynchronous collective op could not be built ({_loaded[1]}); "
                              f"collectives in graphs run as tf.numpy_function, which deadlocks when ranks run "
                              f"independent collectives in different orders. Install a C++ compiler to fix it.",
                              RuntimeWarning, stacklevel=3)
    return _loaded


def why_not():
    module, reason = load()
    return None if module is not None else reason


def call(fn, inputs, out_dtypes, name):
    """The op's outputs (a list) running fn on `inputs` in the graph being built; None when the op is unavailable."""
    module, library = load()
    if module is None:
        return None
    with _lock:
        call_id = len(_calls)
        _calls.append((fn, list(out_dtypes), name))
    return module.ringtrain_host_call(list(inputs), Tout=list(out_dtypes), call=call_id, name=name)


class RankMismatchError(TensorMismatchError, tf.errors.FailedPreconditionError):
    """Ranks disagree on a collective (shape, dtype, op, root): Horovod's tf.errors.FailedPreconditionError, and
    ringtrain's TensorMismatchError, so either `except` catches it. Raised eagerly; in a graph TensorFlow raises
    its own FailedPreconditionError with the same message."""

    def __init__(self, message):
        tf.errors.FailedPreconditionError.__init__(self, None, None, message)

    def __str__(self):
        return self.message


def as_tf_error(error):
    """Horovod's TF error type for a ringtrain error raised eagerly (others are returned unchanged)."""
    if isinstance(error, TensorMismatchError) and not isinstance(error, RankMismatchError):
        return RankMismatchError(str(error))
    return error


# ---------------------------------------------------------------- the Python side of the kernel

def _status_of(error):
    if isinstance(error, TensorMismatchError):
        return _FAILED_PRECONDITION, f"{type(error).__name__}: {error}"
    if isinstance(error, (ValueError, TypeError)):
        return _INVALID_ARGUMENT, f"{type(error).__name__}: {error}"
    return _UNKNOWN, f"{type(error).__name__}: {error}"


def _view(dtype_enum, shape, address):
    dtype = np.dtype(tf.dtypes.as_dtype(dtype_enum).as_numpy_dtype)
    count = int(np.prod(shape, dtype=np.int64))
    if count == 0 or not address:
        return np.empty(shape, dtype)
    buffer = (ctypes.c_char * (count * dtype.itemsize)).from_address(address)
    return np.frombuffer(buffer, dtype).reshape(shape)


def _start(call_id, token, num_inputs, dtypes, ranks, dims, data, error, error_size):
    try:
        fn, out_dtypes, _ = _calls[call_id]
        arrays, at = [], 0
        for i in range(num_inputs):
            shape = tuple(dims[at + d] for d in range(ranks[i]))
            at += ranks[i]
            arrays.append(_view(dtypes[i], shape, data[i]))
        _waiters.put(lambda: _run(token, fn, out_dtypes, arrays))
        return 0
    except BaseException as e:       # noqa: BLE001 -- nothing may cross into C; TF reports it
        code, message = _status_of(e)
        ctypes.memmove(error, message.encode()[:error_size - 1] + b"\0", min(len(message.encode()) + 1, error_size))
        return code


def _run(token, fn, out_dtypes, arrays):
    """On a waiter thread: run the collective, hand its results to TF, end the call (whatever happens)."""
    _, library = _loaded
    try:
        results = fn(*arrays)
        for index, (result, dtype) in enumerate(zip(results, out_dtypes)):
            _set_output(library, token, index, np.asarray(result, dtype=dtype.as_numpy_dtype))
    except BaseException as e:       # noqa: BLE001
        code, message = _status_of(e)
        library.ringtrain_tf_finish(token, code, message.encode())
        return
    library.ringtrain_tf_finish(token, _OK, b"")


def _set_output(library, token, index, array):
    dims = (ctypes.c_int64 * max(1, array.ndim))(*array.shape)
    if (array.size and array.flags.c_contiguous and array.ctypes.data % TF_ALIGNMENT == 0):
        keep = next(_keep_ids)
        _kept[keep] = array
        library.ringtrain_tf_adopt_output(token, index, array.ndim, dims, array.ctypes.data, array.nbytes, keep)
        return
    error = ctypes.create_string_buffer(1024)
    address = library.ringtrain_tf_output(token, index, array.ndim, dims, error, len(error))
    if not address:
        raise RuntimeError(f"TensorFlow could not allocate output {index}: {error.value.decode()}")
    if array.size:
        ctypes.memmove(address, np.ascontiguousarray(array).ctypes.data, array.nbytes)


def _release(keep_id):
    _kept.pop(keep_id, None)


_START = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                          ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int32),
                          ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p,
                          ctypes.c_int64)(_start)
_RELEASE = ctypes.CFUNCTYPE(None, ctypes.c_int64)(_release)


class _Waiters:
    """Threads that run collectives for the op: a job never waits for a thread (one is started when none is idle),
    so a collective blocked on other ranks never keeps another one from starting."""

    def __init__(self):
        self._jobs = queue.SimpleQueue()
        self._idle = 0
        self._count = 0
        self._lock = threading.Lock()

    def put(self, job):
        with self._lock:
            start = self._idle == 0
            if start:
                self._count += 1
            else:
                self._idle -= 1
        self._jobs.put(job)
        if start:
            threading.Thread(target=self._loop, name=f"ringtrain-tf-{self._count}", daemon=True).start()

    def _loop(self):
        while True:
            job = self._jobs.get()
            job()
            with self._lock:
                self._idle += 1


_waiters = _Waiters()


def _stop_releasing():
    """At exit TF may free adopted tensors after Python is gone: stop calling into it."""
    if _loaded is not None and _loaded[0] is not None:
        _loaded[1].ringtrain_tf_set_release(None)


atexit.register(_stop_releasing)
