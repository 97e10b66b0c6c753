"""Collectives inside jax.jit as XLA FFI custom calls whose buffers are handed to Python without a copy.

    call = ffi_target.register(run_into, spec, ctx.avals_in, ctx.avals_out)      # at lowering time
    results = ffi_target.lowering(ctx_with_token, *operands, token, call=call)  # one custom call

XLA runs the custom call `ringtrain_host_call` (csrc/xla_host_call.cc, built by ffi_build.py), which passes the
addresses of its input and output buffers to `_host` below; `_host` wraps them as numpy arrays (the inputs
read-only) and calls `run_into(inputs, outputs, spec)`, which writes the results straight into XLA's output
buffers. JAX's own Python host callback instead gives the callback its inputs, takes the arrays it returns and
copies them into the output buffers -- one more copy of every result, plus JAX's wrapping of every array.

The table of lowered calls only grows (one entry per lowering of a collective, i.e. per compiled program that
contains it), like JAX's own registry of host callbacks.
"""
import ctypes
import threading
import warnings

import jax
import numpy as np

from ringtrain.core import state
from ringtrain.config import Config

from . import ffi_build

TARGET = "ringtrain_host_call"
HOST_FUNCTION = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.POINTER(ctypes.c_void_p),
                                 ctypes.c_int64, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_int64)
_calls = []                 # the custom call's "call" attribute indexes this: (run_into, spec, inputs, outputs)
_lock = threading.Lock()
_state = {}                 # "library": the loaded handler (or None), "reason": why not


class _Memory:
    """A numpy array interface over an XLA buffer at `address` (no copy): shape and dtype given directly, one
    numpy call per view (XLA hands every call fresh buffers, so views are made every call)."""
    __slots__ = ("__array_interface__",)

    def __init__(self, address, shape, typestr, readonly):
        self.__array_interface__ = {"data": (address, readonly), "shape": shape, "typestr": typestr,
                                    "version": 3}


def _layout(aval):
    dtype = np.dtype(aval.dtype)
    return tuple(aval.shape), dtype, int(np.prod(aval.shape, dtype=np.int64)) * dtype.itemsize


def _view(address, layout, readonly):
    shape, dtype, nbytes = layout
    if nbytes == 0:                           # XLA may pass no address for an empty buffer
        empty = np.empty(shape, dtype)
        empty.flags.writeable = not readonly
        return empty
    return np.asarray(_Memory(address, shape, dtype.str, readonly)).view(dtype)


def _host(call, num_inputs, inputs, num_outputs, outputs, error, error_size):
    """Called by the FFI handler on XLA's thread (ctypes takes the GIL). Returns 0, or 1 with a message in
    `error` that XLA raises on the caller (as jax.errors.JaxRuntimeError)."""
    try:
        run_into, spec, in_layouts, out_layouts = _calls[call]
        if num_inputs != len(in_layouts) or num_outputs != len(out_layouts):
            raise RuntimeError(f"ringtrain host call {call}: XLA passed {num_inputs} inputs and {num_outputs} "
                               f"outputs, the lowering declared {len(in_layouts)} and {len(out_layouts)}")
        run_into([_view(inputs[i], layout, True) for i, layout in enumerate(in_layouts)],
                 [_view(outputs[i], layout, False) for i, layout in enumerate(out_layouts)], spec)
        return 0
    except BaseException as e:      # nothing may propagate into XLA's thread: the error goes back through XLA
        message = f"{type(e).__name__}: {e}".encode("utf-8", "replace")[:max(error_size - 1, 0)] + b"\0"
        ctypes.memmove(error, message, len(message))
        return 1


_host_function = HOST_FUNCTION(_host)     # kept alive for the life of the process: the handler calls it


def register(run_into, spec, avals_in, avals_out):
    """The `call` attribute of a new custom call running run_into(inputs, outputs, spec)."""
    with _lock:
        _calls.append((run_into, spec, [_layout(a) for a in avals_in], [_layout(a) for a in avals_out]))
        return len(_calls) - 1


def lowering(ctx, *operands, call, in_place=0):
    """Emit the custom call (ctx's avals include the token operand and result, if any). in_place=n: its first n
    results are its first n operands' buffers (XLA copies an operand first where it is still needed)."""
    aliases = {i: i for i in range(in_place)}
    return jax.ffi.ffi_lowering(TARGET, has_side_effect=True, operand_output_aliases=aliases)(ctx, *operands,
                                                                                              call=np.int64(call))


def _load():
    """Build, load and register the handler once per process."""
    with _lock:
        if not _state:
            library, reason = ffi_build.load()
            if library is not None:
                library.ringtrain_set_host_function(_host_function)
                jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.ringtrain_host_call), platform="cpu")
            _state.update(library=library, reason=reason)
    return _state["library"], _state["reason"]


def use_ffi(platform):
    """Whether collectives lowered now for `platform` become FFI custom calls (RINGTRAIN_JAX_LOWERING: auto, ffi
    or callback). auto falls back to JAX's Python host callback, with a warning, when the handler cannot be
    built; ffi raises instead."""
    choice = _configured_lowering()
    if choice == "callback" or platform != "cpu":
        return False
    library, reason = _load()
    if library is not None:
        return True
    message = (f"ringtrain.jax could not build its XLA FFI handler ({reason}); collectives inside jax.jit use "
               "JAX's Python host callback instead, which copies every result once more. A C++ compiler "
               "($CXX or c++) and jaxlib's headers are needed for the fast path.")
    if choice == "ffi":
        raise RuntimeError(message + " RINGTRAIN_JAX_LOWERING=ffi asked for it.")
    if not _state.get("warned"):
        _state["warned"] = True
        warnings.warn(message, RuntimeWarning, stacklevel=2)
    return False


def _configured_lowering():
    choice = (state.config() if state.is_initialized() else Config.from_env()).jax_lowering
    if choice not in ("auto", "ffi", "callback"):
        raise ValueError(f"RINGTRAIN_JAX_LOWERING must be auto, ffi or callback, not {choice!r}")
    return choice
