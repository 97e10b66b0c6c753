"""Reduction ops and the dtype table shared by every layer (numpy names; bfloat16 comes from ml_dtypes)."""
import enum

import ml_dtypes
import numpy as np

from .errors import UnsupportedDtypeError, UnsupportedOperationError


class ReduceOp(enum.IntEnum):
    """How a collective combines the ranks' values, element by element: Sum, Average (the sum divided by the number
    of ranks; integers rounded toward zero, as Horovod), Min, Max or Product. Adasum (below) is not elementwise and
    is not one of them."""
    AVERAGE = 0
    SUM = 1
    MIN = 2
    MAX = 3
    PRODUCT = 4


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT


class _Adasum:
    """Horovod's Adasum op: allreduce and grouped_allreduce (and the bindings' DistributedOptimizer) combine the
    ranks' float tensors by the adaptive summation rule (see ringtrain.core.adasum); other collectives refuse it."""

    def __repr__(self):
        return "Adasum"


Adasum = _Adasum()

bfloat16 = np.dtype(ml_dtypes.bfloat16)

# name -> numpy dtype, in the order the wire and the kernels number them
DTYPES = {
    "float16": np.dtype(np.float16),
    "bfloat16": bfloat16,
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "int8": np.dtype(np.int8),
    "uint8": np.dtype(np.uint8),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "bool": np.dtype(np.bool_),
    "int16": np.dtype(np.int16),      # appended, not inserted: earlier entries keep their numbers
    "uint16": np.dtype(np.uint16),
}
_BY_DTYPE = {dt: name for name, dt in DTYPES.items()}

# numpy ufunc doing the elementwise combine of each op (Average reduces as Sum, then scales)
UFUNCS = {
    ReduceOp.AVERAGE: np.add,
    ReduceOp.SUM: np.add,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.PRODUCT: np.multiply,
}


def is_adasum(op):
    return op is Adasum or (isinstance(op, str) and op.lower() == "adasum")


def as_allreduce_op(op):
    """as_op(), but Adasum (the object or the name 'adasum') is returned as Adasum: what allreduce accepts."""
    return Adasum if is_adasum(op) else as_op(op)


def as_op(op):
    """Accept ReduceOp, its int value, or a name such as 'sum' / 'Average'. Adasum raises UnsupportedOperationError:
    callers that take it use as_allreduce_op()."""
    if is_adasum(op):
        raise UnsupportedOperationError("op=Adasum applies to allreduce, grouped_allreduce and DistributedOptimizer "
                                        "only; use Average (the default) or Sum here")
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str):
        try:
            return ReduceOp[op.upper()]
        except KeyError:
            pass
    elif isinstance(op, int):
        try:
            return ReduceOp(op)
        except ValueError:
            pass
    raise ValueError(f"unknown reduce op {op!r}; use one of {[o.name.title() for o in ReduceOp]}")



def resolve_op(op, average, adasum=False):
    """A binding's `op=` / Horovod's deprecated `average=` flag: `op` wins when both are given; neither means
    Average, average=False means Sum. adasum=True: Adasum is accepted (allreduce's forms)."""
    if op is not None:
        return as_allreduce_op(op) if adasum else as_op(op)
    if average is None or average:
        return Average
    return Sum

def dtype_name(dtype):
    """The table name of a supported dtype, else UnsupportedDtypeError naming it."""
    dt = np.dtype(dtype)
    try:
        return _BY_DTYPE[dt]
    except KeyError:
        raise UnsupportedDtypeError(
            f"dtype {dt} is not supported; supported: {', '.join(DTYPES)}") from None


def check_op_dtype(op, dtype):
    """bool only makes sense for Min/Max (logical and/or) and Sum/Product would overflow meaning."""
    name = dtype_name(dtype)
    if name == "bool" and op not in (ReduceOp.MIN, ReduceOp.MAX):
        raise UnsupportedDtypeError(f"op {op.name.title()} is not defined for bool; use Min (and) or Max (or)")
    return name


def result_scale(op, postscale, size):
    """What multiplies a reduction's result: the postscale factor, and for Average 1/size -- the whole world's
    size, joined ranks included (they contribute zeros, as in DDP's join)."""
    return postscale / size if op == ReduceOp.AVERAGE else postscale


def reduce_into(dst, src, op):
    """dst <- dst (op) src, elementwise, in place. Average combines as Sum."""
    UFUNCS[op](dst, src, out=dst)


def reduce_in_rank_order(out, arrays, op, scale=1.0):
    """out <- scale * (arrays[0] op arrays[1] op ...), combined left to right: ranks that reduce the same copies in
    the same order compute bitwise the same result, with no message to agree on it."""
    ufunc = UFUNCS[op]
    ufunc(arrays[0], arrays[1], out=out)
    for array in arrays[2:]:
        ufunc(out, array, out=out)
    if scale != 1.0:
        scale_into(out, out, scale)


def truncating_divide(src, divisor, dst):
    """dst <- src / divisor for integers, rounded toward zero as Horovod's integer Average (-75 / 2 = -37, where
    numpy's floor_divide gives -38). dst may be src."""
    if src.dtype.kind == "u":
        np.floor_divide(src, divisor, out=dst)
        return
    round_up = (np.remainder(src, divisor) != 0) & (src < 0)    # before dst overwrites src
    np.floor_divide(src, divisor, out=dst)
    np.add(dst, round_up, out=dst, casting="unsafe")


def scale_into(dst, src, factor):
    """dst <- src * factor; integers divide by the inverse, rounding toward zero, when factor is 1/N."""
    if factor == 1.0:
        if dst is not src:
            np.copyto(dst, src)
        return
    if dst.dtype.kind in "iu":
        inv = round(1.0 / factor)
        if abs(inv * factor - 1.0) < 1e-12:
            truncating_divide(src, inv, dst)
        else:
            np.copyto(dst, (src * factor).astype(dst.dtype))
    elif dst.dtype.itemsize == 2:
        # float16/bfloat16 scale in float32 and round once (as Horovod and our GPU kernels do): a factor rounded
        # to 16 bits first would make a prescaled Sum differ from size * fp16(factor * x)
        np.multiply(src, np.float32(factor), out=dst, dtype=np.float32, casting="unsafe")
    else:
        np.multiply(src, np.asarray(factor, dtype=dst.dtype), out=dst)
