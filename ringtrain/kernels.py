"""The only place that compiles csrc/*.cu: typed launch helpers for ringtrain's own CUDA kernels.

    import cupy as cp
    from ringtrain import kernels
    from ringtrain.ops import ReduceOp

    a, b = cp.arange(10, dtype=cp.float32), cp.ones(10, dtype=cp.float32)
    kernels.reduce(a, b, ReduceOp.SUM)                  # a <- a + b
    kernels.reduce(a, b, ReduceOp.AVERAGE, scale=0.5)   # a <- (a + b) * 0.5, one pass
    buf = cp.empty(20, cp.float32)
    kernels.pack([a, b], buf)                           # buf = [a, b], one launch for any number of tensors
    kernels.unpack(buf, [a, b], scale=0.25)             # a, b = buf pieces * 0.25

Each .cu file becomes one cupy.RawModule (NVRTC), compiled once per device and cached (CuPy also keeps the
binary in its on-disk kernel cache, so a second process pays no compile time). Every helper takes `stream`
(default: the current cupy stream) and never synchronises.

The sources are found inside the package in an installed wheel (ringtrain/_csrc, shipped by setup.py) and next
to it in a source checkout (<repo>/csrc). This module imports cupy at import time: import it only on the GPU path.
"""
import math
import os
import threading

import cupy
import numpy as np

from . import csrc, ops
from .errors import UnsupportedDtypeError
from .ops import ReduceOp

THREADS = 256          # threads per block: 8 warps keeps an SM's memory pipeline full with 16-byte loads
BLOCKS_PER_SM = 8      # grid-stride loops need only enough blocks to fill every SM several times over
BATCHED_BLOCKS_PER_SM = 32   # batched copies of misaligned tensors move 4-byte units: more loads in flight
MAX_GRID_Y = 65535     # CUDA's limit on gridDim.y (rows of a batched launch stride past it)

SOURCES = ("reduce.cu", "batched_copy.cu", "cast.cu")
_OP_NAMES = {ReduceOp.AVERAGE: "sum", ReduceOp.SUM: "sum", ReduceOp.MIN: "min", ReduceOp.MAX: "max",
             ReduceOp.PRODUCT: "product"}
_CAST_PAIRS = {("float32", "float16"), ("float32", "bfloat16"), ("float16", "float32"), ("bfloat16", "float32")}

_lock = threading.Lock()
_modules = {}          # (device id, file name) -> cupy.RawModule
_sm_counts = {}        # device id -> multiprocessor count
_tables = {}           # (device id, rows) -> device int64 table of a batched launch, reused across steps
_TABLE_CACHE = 256


def csrc_dir():
    """Directory holding the .cu sources: ringtrain/_csrc in an installed wheel (setup.py copies them there),
    else <repo>/csrc in a source checkout or editable install."""
    return csrc.find(SOURCES)


def module(filename):
    """The compiled RawModule of one csrc file on the current device (compiled on first use)."""
    device = cupy.cuda.runtime.getDevice()
    key = (device, filename)
    mod = _modules.get(key)
    if mod is None:
        with _lock:
            mod = _modules.get(key)
            if mod is None:
                directory = csrc_dir()
                with open(os.path.join(directory, filename)) as f:
                    code = f.read()
                mod = cupy.RawModule(code=code, options=("-I" + directory, "--std=c++17"))
                _modules[key] = mod
    return mod


def _kernel(filename, name):
    return module(filename).get_function(name)


def _blocks(units, per_sm=BLOCKS_PER_SM):
    device = cupy.cuda.runtime.getDevice()
    sms = _sm_counts.get(device)
    if sms is None:
        sms = _sm_counts[device] = cupy.cuda.Device(device).attributes["MultiProcessorCount"]
    return max(1, min(math.ceil(units / THREADS), sms * per_sm))


def _ptr(array):
    return np.uint64(array.data.ptr)


def _kernel_dtype(dtype, op=None):
    """Kernel symbol suffix of a dtype; bool runs the uint8 kernels (Min/Max on 0/1 are and/or)."""
    name = ops.dtype_name(dtype) if op is None else ops.check_op_dtype(op, dtype)
    return "uint8" if name == "bool" else name


def integer_divisor(dtype, scale):
    """round(1/scale) when scale is exactly 1/k for an integer dtype (the kernels then divide, rounding toward zero
    as ringtrain.ops.scale_into does), else 0 (multiply and truncate)."""
    if np.dtype(dtype).kind not in "iub" or scale == 1.0 or scale == 0.0:
        return 0
    inv = round(1.0 / scale)
    return int(inv) if inv > 1 and abs(inv * scale - 1.0) < 1e-12 else 0


def _check_same(a, b, what):
    if a.dtype != b.dtype or a.size != b.size:
        raise ValueError(f"{what}: arrays differ: {a.size} {a.dtype} vs {b.size} {b.dtype}")
    for x in (a, b):
        if not x.flags.c_contiguous:
            raise ValueError(f"{what}: array of shape {x.shape} is not contiguous")


def reduce(dst, src, op, scale=1.0, stream=None):
    """dst <- (dst op src) * scale in place, one launch. Average reduces as Sum (pass scale=1/N to fuse it)."""
    op = ops.as_op(op)
    _check_same(dst, src, f"reduce {op.name.lower()}")
    n = dst.size
    if n == 0:
        return dst
    kernel = _kernel("reduce.cu", f"reduce_{_OP_NAMES[op]}_{_kernel_dtype(dst.dtype, op)}")
    vector = 16 // dst.itemsize
    kernel((_blocks(math.ceil(n / vector)),), (THREADS,),
           (_ptr(dst), _ptr(src), np.int64(n), np.float64(scale), np.int64(integer_divisor(dst.dtype, scale))),
           stream=stream)
    return dst


def _table(rows):
    """Device copy of the launch table; cached, since a training step packs the same tensors every step."""
    key = (cupy.cuda.runtime.getDevice(), rows)
    table = _tables.get(key)
    if table is None:
        if len(_tables) >= _TABLE_CACHE:
            _tables.clear()
        table = _tables[key] = cupy.asarray(np.array(rows, dtype=np.int64).reshape(-1))
    return table


def _batched_launch(kernel, rows, max_units, extra_args, stream):
    if not rows:
        return
    grid_y = min(len(rows), MAX_GRID_Y)
    grid_x = max(1, min(math.ceil(max_units / THREADS),
                        _blocks(max_units * len(rows), BATCHED_BLOCKS_PER_SM) // grid_y or 1))
    kernel((grid_x, grid_y), (THREADS,), (_table(tuple(rows)), np.int32(len(rows))) + extra_args, stream=stream)


def batched_copy(pairs, stream=None):
    """Copy every (dst, src) pair of equally sized contiguous arrays in one launch."""
    batched_copy_launcher(pairs)(stream)


def batched_copy_launcher(pairs):
    """A function(stream) that launches the batched copy of `pairs`; the table is built once (benchmarks use
    this to time the kernel without the Python that lists the tensors)."""
    rows, longest = [], 0
    for dst, src in pairs:
        if dst.nbytes != src.nbytes:
            raise ValueError(f"batched copy: {dst.nbytes} destination bytes for {src.nbytes} source bytes")
        if dst.nbytes:
            rows.append((dst.data.ptr, src.data.ptr, dst.nbytes))
            longest = max(longest, dst.nbytes)
    kernel = _kernel("batched_copy.cu", "batched_copy")
    return lambda stream=None: _batched_launch(kernel, rows, math.ceil(longest / 16), (), stream)


def batched_scale(pairs, scale, stream=None):
    """dst <- src * scale for every (dst, src) pair of one dtype, in one launch (integers: see integer_divisor)."""
    pairs = [(d, s) for d, s in pairs if d.size]
    if not pairs:
        return
    dtype = pairs[0][0].dtype
    for dst, src in pairs:
        if dst.dtype != dtype or src.dtype != dtype or dst.size != src.size:
            raise ValueError(f"batched scale: every pair must be {dtype} and equally long; got "
                             f"{dst.size} {dst.dtype} <- {src.size} {src.dtype}")
    rows = [(d.data.ptr, s.data.ptr, d.size) for d, s in pairs]
    longest = max(r[2] for r in rows)
    kernel = _kernel("batched_copy.cu", f"batched_scale_{_kernel_dtype(dtype)}")
    _batched_launch(kernel, rows, math.ceil(longest * dtype.itemsize / 16),
                    (np.float64(scale), np.int64(integer_divisor(dtype, scale))), stream)


def _slices(buf, arrays):
    offset, out = 0, []
    for a in arrays:
        out.append(buf[offset: offset + a.size])
        offset += a.size
    if offset > buf.size:
        raise ValueError(f"fusion buffer of {buf.size} elements is too small for {offset} elements")
    return out


def pack(srcs, dst_buf, stream=None):
    """Copy the flat arrays `srcs` back to back into the 1-D dst_buf, in one launch; returns elements written."""
    srcs = [s.reshape(-1) for s in srcs]
    for s in srcs:
        if s.dtype != dst_buf.dtype:
            raise ValueError(f"pack: a {s.dtype} tensor cannot go into a {dst_buf.dtype} fusion buffer")
    batched_copy(list(zip(_slices(dst_buf, srcs), srcs)), stream)
    return sum(s.size for s in srcs)


def unpack(src_buf, dsts, scale=1.0, stream=None):
    """Copy consecutive pieces of src_buf into the flat arrays `dsts`, multiplied by scale, in one launch."""
    dsts = [d.reshape(-1) for d in dsts]
    for d in dsts:
        if d.dtype != src_buf.dtype:
            raise ValueError(f"unpack: a {src_buf.dtype} fusion buffer cannot fill a {d.dtype} tensor")
    pairs = list(zip(dsts, _slices(src_buf, dsts)))
    if scale == 1.0:
        batched_copy(pairs, stream)
    else:
        batched_scale(pairs, scale, stream)


def cast(dst, src, scale=1.0, stream=None):
    """dst <- dst.dtype(src * scale) for float32 <-> float16/bfloat16 (gradient compression), one launch."""
    pair = (ops.dtype_name(src.dtype), ops.dtype_name(dst.dtype))
    if pair not in _CAST_PAIRS:
        raise UnsupportedDtypeError(f"cast from {pair[0]} to {pair[1]} is not supported; supported: "
                                    f"{sorted(_CAST_PAIRS)}")
    if dst.size != src.size:
        raise ValueError(f"cast: {src.size} source elements for {dst.size} destination elements")
    if src.size == 0:
        return dst
    kernel = _kernel("cast.cu", f"cast_{pair[0]}_to_{pair[1]}")
    kernel((_blocks(math.ceil(src.size / 4)),), (THREADS,),
           (_ptr(dst), _ptr(src), np.int64(src.size), np.float32(scale)), stream=stream)
    return dst
