"""Writes into memory the process has not touched lately (a fresh result array) without reading it into the cache first.

    from ringtrain import stream_copy
    if stream_copy.available():
        stream_copy.copy(dst, src)                        # dst[...] = src, C-contiguous; non-temporal stores
        stream_copy.reduce_push(dst, a, [b, c], 0.5)      # b[...] = c[...] = (a + b + c) * 0.5, streamed into dst

An ordinary store to a line that is not in the cache first reads the line from memory ("write-allocate"), so
writing a fresh 16 MB result costs 16 MB read + 16 MB written, where the same write into the input (in place, its
lines just read) costs only the write back. Non-temporal stores (csrc/stream_copy.c, x86-64 with AVX) skip that
read: an out-of-place allreduce whose result is written so moves what the in-place one moves (one process, 16 MB
float32, a + b into a fresh array: 1.6 ms streamed, 2.3 ms numpy, 1.7 ms numpy in place). They also leave the data
out of the caches, so they pay only for results that do not fit there anyway (STREAM_BYTES and up).

The compiled module is a tiny CPython extension, built on first use with the host's C compiler ($CC, else cc)
against this Python's headers into ringtrain's per-user cache, under a name that hashes the source, the Python
version and the command (as the express cycle's). Not available (no compiler, a build error, or a CPU without AVX):
the shm transport writes results as before, with the same bits; RINGTRAIN_NATIVE=0 turns it off there too.
"""
import os
import shlex
import sys
import sysconfig

import numpy as np

from . import csrc

SOURCE = "stream_copy.c"
# The whole result of a collective from this size up is written with non-temporal stores: about half a core's
# share of the last-level cache and more never stays cached for its reader anyway.
STREAM_BYTES = 4 << 20


def compiler_command():
    return shlex.split(os.environ.get("CC", "cc")) + [
        "-O2", "-std=gnu11", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC", "-w",
        "-I" + sysconfig.get_paths()["include"]]


def _load():
    module = csrc.load_extension("_stream_copy", csrc.built(SOURCE, compiler_command(), key=[sys.version],
                                                            suffix=sysconfig.get_config_var("EXT_SUFFIX")))
    return module if module.streams() else "this CPU has no non-temporal stores the module uses"


# the compiled module, or a str saying why it is not available (built once per process, on first use)
library = csrc.OnFirstUse(_load)


def available():
    return not isinstance(library(), str)


_KINDS = {np.dtype(np.float32): 0, np.dtype(np.float64): 1}


def reduces(dtype):
    """Does reduce_push take arrays of this dtype (float32, float64)?"""
    return dtype in _KINDS


def copy(dst, src):
    """dst[...] = src for C-contiguous arrays of one dtype and size, dst's lines streamed to memory."""
    module = library()
    if isinstance(module, str):
        np.copyto(dst, src)
        return
    module.copy(_bytes(dst), _bytes(src))


def reduce_push(dst, own, regions, scale):
    """acc = own + regions[0] + regions[1] + ... (in that order), times scale unless it is 1; acc into every array of
    regions and streamed into dst. C-contiguous arrays of one size and a dtype reduces() takes; the same bits as
    numpy's adds in that order and ops.scale_into."""
    library().reduce_push(_KINDS[dst.dtype], _bytes(dst), _bytes(own), tuple(_bytes(r) for r in regions),
                          float(scale))


def _bytes(a):
    """The bytes of a C-contiguous array, as a flat uint8 array (the module's buffers; a 0-d or empty one works)."""
    return a.reshape(-1).view(np.uint8)
