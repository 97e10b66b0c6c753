"""jax.Array <-> numpy without copies where JAX allows it, and the wire form of dtypes the core does not reduce.

Measured with jax 0.10 on CPU:
- jax -> numpy: `np.asarray(x)` of a CPU jax.Array is a read-only view of its buffer (no copy, any size); the core
  only reads its inputs.
- numpy -> jax: XLA's CPU client adopts a numpy buffer without a copy when its data is 64-byte aligned (XLA's CPU
  alignment; an unaligned buffer is copied) and holds a reference to it, so results are allocated aligned
  (`aligned_empty`). `to_jax` hands the array to the client directly (jax._src's batched_device_put, as
  jax.device_put ends up doing: the JAX minor version is pinned): 4-8 us at 4 KB to 16 MB, where `jnp.asarray`
  costs ~25 us at 4 KB (and copies) and `jax.dlpack.from_dlpack` 34-70 us. The array lands on JAX's default device,
  as jnp.asarray's would, uncommitted and not weakly typed.
- small results (`copy_to_jax`): below COPIED_BYTES XLA's client copies the bytes (host-buffer semantics
  IMMUTABLE_ONLY_DURING_CALL) out of a plain numpy array, which is the caller's again when the call returns: no
  aligned allocation and no alias to release when the jax.Array dies. One process, a jax.Array in, a numpy result,
  a new jax.Array out and freed: 4 KB the same as adopting an aligned row (7.8 us both, loaded machine), 16 KB
  3.1 us less, 64 KB 2.0 us less (aligned buffers past the rows' 16 KB are allocated in Python); equal at 256 KB.

Wire dtypes. The core reduces the dtypes in ringtrain.ops.DTYPES. JAX on CPU also has uint32, uint64, complex64 and
complex128; they travel as views the core understands, with no copy for data movement:
- uint32 / uint64 go as int32 / int64: Sum and Product are the same modular arithmetic bit for bit; Min and Max
  flip the top bit first (that maps unsigned order onto signed order); Average is a Sum floor-divided by the set's
  size afterwards, as the core does for signed integers.
- complex64 / complex128 go as float32 / float64 (real, imaginary) pairs in a trailing axis: Sum and Average are
  exact; Min, Max and Product are not defined on pairs and raise UnsupportedDtypeError.
Unsupported combinations are refused when the collective is traced (check_reduction, check_movable), on the
caller's rank, before anything runs.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core as jax_core
from jax._src.interpreters import pxla
from jax._src.lib import _jax, xla_client
from jax._src.sharding_impls import SingleDeviceSharding

from ringtrain import aligned
from ringtrain.core import adasum
from ringtrain.errors import UnsupportedDtypeError
from ringtrain.ops import Adasum, Average, Max, Min, Sum, check_op_dtype, dtype_name

XLA_ALIGNMENT = 64
_UNSIGNED_AS_SIGNED = {np.dtype(np.uint32): np.dtype(np.int32), np.dtype(np.uint64): np.dtype(np.int64)}
_COMPLEX_AS_REAL = {np.dtype(np.complex64): np.dtype(np.float32), np.dtype(np.complex128): np.dtype(np.float64)}
WIRE_VIEWED = frozenset(_UNSIGNED_AS_SIGNED) | frozenset(_COMPLEX_AS_REAL)     # the dtypes that travel as a Wire view


def aligned_empty(shape, dtype):
    """An uninitialised C-contiguous numpy array whose data starts on an XLA_ALIGNMENT boundary."""
    return aligned.aligned_empty(shape, dtype, XLA_ALIGNMENT)


_SMALL = aligned.Results(XLA_ALIGNMENT)


# result_empty(shape, dtype): aligned_empty for a result handed to JAX (to_jax); small ones are rows of shared
# blocks (~0.3 us, not 3.5). The bound method itself: the eager call pays no frame of ours for it
result_empty = _SMALL.empty


def to_numpy(x):
    """A C-contiguous numpy array with x's data: a read-only view for a CPU jax.Array."""
    array = np.asarray(x)
    return array if array.flags.c_contiguous else np.ascontiguousarray(array)


_AVALS = {}          # (shape, dtype) -> jax's abstract value of such an array (building one costs ~2 us)
_SHARDINGS = {}      # device -> its SingleDeviceSharding


def aval_of(shape, dtype):
    aval = _AVALS.get((shape, dtype))
    if aval is None:
        if len(_AVALS) >= 1024:
            _AVALS.clear()
        aval = _AVALS[(shape, dtype)] = jax_core.ShapedArray(shape, dtype)
    return aval


def to_jax(array):
    """A jax.Array holding `array` on JAX's default device: zero-copy when C-contiguous and 64-byte aligned, else a
    copy. The array must not be written afterwards (the jax.Array may be its memory)."""
    if isinstance(array, jax.Array):
        return array
    array = np.asarray(array)
    if not array.flags.c_contiguous or jax.dtypes.canonicalize_dtype(array.dtype) != array.dtype:
        return jnp.asarray(array)        # a copy (and float64 -> float32 without x64), as JAX does
    return adopt(array, aval_of(array.shape, array.dtype))


COPIED_BYTES = 256 << 10     # results below this size reach JAX as copies (copy_to_jax), larger ones adopted
_COPY = _jax.HostBufferSemantics.IMMUTABLE_ONLY_DURING_CALL
_PLACES = {}         # (shape, dtype, device) -> (aval, sharding, [device]): what batched_device_put needs


def copy_to_jax(array):
    """A new jax.Array on JAX's default device holding a copy of `array` (C-contiguous, of a dtype JAX keeps as it
    is), which XLA's client makes before returning: the numpy array may be written or freed right after."""
    key = (array.shape, array.dtype, pxla.get_default_device())
    place = _PLACES.get(key)
    if place is None:
        if len(_PLACES) >= 1024:
            _PLACES.clear()
        place = _PLACES[key] = (jax_core.ShapedArray(array.shape, array.dtype), SingleDeviceSharding(key[2]),
                                [key[2]])
    return xla_client.batched_device_put(place[0], place[1], [array], place[2], False, False, _COPY)


def adopt(array, aval):
    """to_jax for a C-contiguous array of a dtype JAX keeps as it is (a result of an input jax.Array's dtype), with
    its abstract value: XLA's client takes it (zero-copy when aligned, as result_empty's are) on the default
    device (jax.default_device may change it: asked every call)."""
    device = pxla.get_default_device()
    sharding = _SHARDINGS.get(device)
    if sharding is None:
        sharding = _SHARDINGS[device] = SingleDeviceSharding(device)
    return xla_client.batched_device_put(aval, sharding, [array], [device], False)


def _top_bit(dtype):
    return dtype.type(1 << (8 * dtype.itemsize - 1))


class Wire:
    """How one array goes to the core and how the core's result comes back: `array` and `op` are what the core
    gets; `back(result)` turns the core's result into the caller's dtype."""
    __slots__ = ("array", "op", "dtype", "divide_by_size")

    def __init__(self, array, op=None):
        self.dtype, self.op, self.divide_by_size = array.dtype, op, False
        if array.dtype in _UNSIGNED_AS_SIGNED:
            signed = _UNSIGNED_AS_SIGNED[array.dtype]
            if op in (Min, Max):
                array = array ^ _top_bit(array.dtype)
            elif op == Average:
                self.op, self.divide_by_size = Sum, True
            self.array = array.view(signed)
        elif array.dtype in _COMPLEX_AS_REAL:
            self.array = array.view(_COMPLEX_AS_REAL[array.dtype]).reshape(array.shape + (2,))
        else:
            self.array = array

    def back(self, result, size=None):
        if self.dtype in _UNSIGNED_AS_SIGNED:
            result = result.view(self.dtype)
            if self.op in (Min, Max):
                result ^= _top_bit(self.dtype)
            elif self.divide_by_size:
                result //= self.dtype.type(size)
            return result
        if self.dtype in _COMPLEX_AS_REAL:
            return result.view(self.dtype).reshape(result.shape[:-1])
        return result


def check_reduction(dtype, op, what):
    """At trace time, on the caller's rank: UnsupportedDtypeError when `op` cannot reduce `dtype` (so bad input
    never reaches the host callback, where JAX would wrap the error)."""
    dtype = np.dtype(dtype)
    if op is Adasum:
        adasum.check([dtype], 1, what)       # float dtypes only (the rank count is checked where it is known)
        return
    if dtype in _COMPLEX_AS_REAL:
        if op not in (Sum, Average):
            raise UnsupportedDtypeError(f"{what}: op {op.name.title()} is not defined for {dtype}; use Sum or "
                                        "Average")
        dtype = _COMPLEX_AS_REAL[dtype]
    check_op_dtype(op, _UNSIGNED_AS_SIGNED.get(dtype, dtype))


def check_movable(dtype, what):
    """At trace time: UnsupportedDtypeError for a dtype no collective can carry (e.g. float8)."""
    dtype = np.dtype(dtype)
    dtype_name(_COMPLEX_AS_REAL.get(dtype, _UNSIGNED_AS_SIGNED.get(dtype, dtype)))


def check_scales(wire, prescale_factor, postscale_factor, what):
    """Average of uint32/uint64 is computed as a Sum divided afterwards: scale factors would be applied twice."""
    if wire.divide_by_size and (prescale_factor != 1.0 or postscale_factor != 1.0):
        raise UnsupportedDtypeError(f"{what}: prescale/postscale factors are not supported for {wire.dtype}")


__all__ = ["COPIED_BYTES", "WIRE_VIEWED", "Wire", "adopt", "aligned_empty", "aval_of", "copy_to_jax", "result_empty",
           "to_jax", "to_numpy"]
