"""Builds csrc/xla_host_call.cc (the XLA FFI handler of ringtrain.jax's collectives) on first use and loads it.

    library, why_not = ffi_build.load()      # a ctypes.CDLL, or None and the reason

Built with the host's C++ compiler ($CXX, else c++) against the XLA FFI headers that jaxlib ships
(jax.ffi.include_dir()), into a per-user cache (`$XDG_CACHE_HOME/ringtrain`, else `~/.cache/ringtrain`) under a name
that hashes the source, the jaxlib version and the compiler command, so a JAX upgrade or an edited source builds
afresh and everything else loads the cached library. Ranks starting together take a file lock: one compiles
(a few seconds), the others wait and load its library. Building at first use rather than in setup.py keeps
`pip install ringtrain[jax]` free of a build step that needs jaxlib's headers in pip's isolated build environment.
"""
import ctypes
import os
import shlex

import jax
import jaxlib

from ringtrain import csrc

SOURCE = "xla_host_call.cc"
SYMBOLS = ("ringtrain_host_call", "ringtrain_set_host_function")
BUILD_TIMEOUT_S = 300
_loaded = None     # (library or None, reason) once tried: a process builds and loads at most once


def compiler_command():
    """The compiler and flags (the library's name hashes them)."""
    return shlex.split(os.environ.get("CXX", "c++")) + ["-O2", "-std=c++17", "-shared", "-fPIC", "-I",
                                                        jax.ffi.include_dir()]


def load():
    """(ctypes.CDLL, None) with the handler built and loaded, or (None, why it could not be)."""
    global _loaded
    if _loaded is None:
        try:
            library = ctypes.CDLL(csrc.built(SOURCE, compiler_command(), key=[jaxlib.__version__],
                                             timeout=BUILD_TIMEOUT_S))
            for symbol in SYMBOLS:
                getattr(library, symbol)          # AttributeError when missing
            _loaded = (library, None)
        except Exception as e:       # no compiler, no headers, read-only home: the caller falls back, loudly
            _loaded = (None, f"{type(e).__name__}: {e}")
    return _loaded
