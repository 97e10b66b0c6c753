"""Adasum (Maleki et al., MLSys 2021) as Horovod reduces it, on two point-to-point steps the caller provides.

Two ranks' tensors a and b combine as

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a  +  (1 - a.b / (2 |b|^2)) b

so orthogonal tensors add, equal tensors average, and a zero tensor leaves the other as it is. 2^k ranks combine as a
binary tree over rank order, adasum(adasum(ranks 0 .. N/2-1), adasum(ranks N/2 .. N-1)), computed as Horovod does
(vector halving, distance doubling): at level k (distance d = 2^k) a rank and its partner rank ^ d hold the same range
of the vector, one for each subtree; each keeps one half of that range (the lower rank the first floor(n/2) elements)
and receives the partner's values of it. The dot product and squared norms of each tensor's part of the half are
summed over the 2d ranks that together hold the whole vector, and every rank combines its half. After log2(N) levels
each rank holds 1/N of the result, and one allgather assembles it.

Small inputs (the ranks' vectors together up to STACKED_BYTES) take one collective instead: every rank's bytes, each
in its own row of a zero array, summed by one allreduce (adding zeros moves the bytes exactly), after which every
rank computes the same tree itself. Larger ones exchange halves as above; the per-level sums travel the same way.

Dot products are per tensor, so tensors reduced together in one call come out as if each were reduced alone. Sums
run in float64; for float64 inputs whose squares would underflow or overflow, on values divided by their largest
magnitude, so the rule holds from a dtype's tiny to sqrt(max). (Horovod treats |a|^2 < 1e-8 as zero and adds;
ringtrain applies the rule at every magnitude.) 16-bit tensors are combined in float32 and rounded once. Every
element of the result is computed by one rank (or identically by all), so all ranks get bitwise the same result.

    reduce_flat(flat, counts, rank, size, steps, what) -> the reduced 1-D vector, over the collectives of `steps`:
    steps.exchange(send, partner, tag) -> the partner's array (send to `partner`, receive from it)
    steps.gather(array, tag, out)      -> every rank's array, concatenated in rank order (into `out` when given,
                                          where `array` may already lie at this rank's place)
    steps.total(array, tag)            -> the Sum of every rank's array (a new array)
"""
import dataclasses
import threading

import numpy as np

from ..engine.handle import Handle
from ..errors import TensorMismatchError, UnsupportedDtypeError, UnsupportedOperationError
from ..ops import dtype_name

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
STACKED_BYTES = 256 << 10   # up to this many bytes of all ranks' vectors together: one allreduce of the stack
_TINY_SUM = 1e-290      # a float64 sum of squares below this may have lost terms to underflow: rescale
_CHUNK = 1 << 15        # elements converted to float64 at a time (stays in cache)
_HUGE_SUM = 1e290       # above this the group's sums (2^k of them) could overflow: rescale


def check(dtypes, size, what):
    """Raise unless Adasum can reduce `dtypes` over `size` ranks (the same answer on every rank of a set)."""
    for dtype in dtypes:
        name = dtype_name(dtype)
        if name not in FLOAT_DTYPES:
            raise UnsupportedDtypeError(f"{what}: op=Adasum reduces {', '.join(FLOAT_DTYPES)} tensors, got {name}")
    if size & (size - 1):
        raise UnsupportedOperationError(f"{what}: op=Adasum needs a power-of-two number of ranks (as Horovod); "
                                        f"this set has {size}")


def final_ranges(total, size):
    """[(lo, hi)] of the part of the result each rank holds after the halving levels, in rank order."""
    ranges = []
    for rank in range(size):
        lo, hi, d = 0, total, 1
        while d < size:
            first = (hi - lo) // 2
            lo, hi = (lo + first, hi) if rank & d else (lo, lo + first)
            d <<= 1
        ranges.append((lo, hi))
    return ranges


def _parts(bounds, lo, hi):
    """(tensor index, start, stop) of each tensor's piece of [lo, hi), relative to lo."""
    first = int(np.searchsorted(bounds, lo, side="right")) - 1
    parts = []
    for t in range(max(first, 0), len(bounds) - 1):
        start, stop = max(bounds[t], lo), min(bounds[t + 1], hi)
        if start >= hi:
            break
        if stop > start:
            parts.append((t, start - lo, stop - lo))
    return parts


def _sums(a, b):
    """(a.b, |a|^2, |b|^2) accumulated in float64; narrower dtypes are converted a cache-sized chunk at a time."""
    if a.dtype == np.float64:
        with np.errstate(over="ignore", under="ignore"):      # detected by the caller, which rescales
            return float(np.dot(a, b)), float(np.dot(a, a)), float(np.dot(b, b))
    dot = aa = bb = 0.0
    for start in range(0, a.size, _CHUNK):
        x, y = a[start:start + _CHUNK].astype(np.float64), b[start:start + _CHUNK].astype(np.float64)
        dot += float(np.dot(x, y))
        aa += float(np.dot(x, x))
        bb += float(np.dot(y, y))
    return dot, aa, bb


def dot_and_norms(a, b):
    """(sa, sb, a.b / (sa sb), |a|^2 / sa^2, |b|^2 / sb^2) in float64. sa = sb = 1 unless plain float64 sums would
    underflow or overflow; then each side is divided by its largest magnitude. A zero side has scale 0."""
    dot, aa, bb = _sums(a, b)
    if _TINY_SUM <= min(aa, bb) and max(aa, bb) <= _HUGE_SUM:     # (False for nan)
        return 1.0, 1.0, dot, aa, bb
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    sa, sb = float(np.max(np.abs(a64), initial=0.0)), float(np.max(np.abs(b64), initial=0.0))
    if not np.isfinite(sa + sb):
        return 1.0, 1.0, dot, aa, bb            # inf or nan in the input: it propagates, as in any sum
    a64 = a64 / sa if sa else a64
    b64 = b64 / sb if sb else b64
    return sa, sb, float(np.dot(a64, b64)), float(np.dot(a64, a64)), float(np.dot(b64, b64))


def coefficients(rows):
    """The rule's two coefficients for one tensor from every group rank's dot_and_norms row (shape (ranks, 5)).
    A zero side keeps the other as it is."""
    top_a, top_b = rows[:, 0].max(), rows[:, 1].max()
    ra = rows[:, 0] / top_a if top_a else rows[:, 0]
    rb = rows[:, 1] / top_b if top_b else rows[:, 1]
    # true sums: a.b = top_a top_b dot, |a|^2 = top_a^2 aa, |b|^2 = top_b^2 bb (each term scaled step by step, so
    # no factor underflows before it meets its value)
    dot = float(np.sum(rows[:, 2] * ra * rb))
    aa = float(np.sum(rows[:, 3] * ra * ra))
    bb = float(np.sum(rows[:, 4] * rb * rb))
    return pair_coefficients(top_a, top_b, dot, aa, bb)


def pair_coefficients(sa, sb, dot, aa, bb):
    """The coefficients from one (sa, sb, dot, |a|^2, |b|^2) of dot_and_norms' form (the sums scaled by sa sb,
    sa^2, sb^2)."""
    c_a = 1.0 - (sb / sa) * (dot / aa) * 0.5 if aa > 0.0 else 1.0
    c_b = 1.0 - (sa / sb) * (dot / bb) * 0.5 if bb > 0.0 else 1.0
    return c_a, c_b


def _scaled_add(keep, c_keep, other, c_other):
    """keep <- c_keep * keep + c_other * other (16-bit floats computed in float32 and rounded once)."""
    for start in range(0, keep.size, _CHUNK):
        k, o = keep[start:start + _CHUNK], other[start:start + _CHUNK]
        if keep.dtype.itemsize == 2:
            k[...] = np.float32(c_keep) * k.astype(np.float32) + np.float32(c_other) * o.astype(np.float32)
        else:
            np.multiply(k, c_keep, out=k)
            k += o * c_other


def _scale(x, factor):
    if factor != 1.0:
        x[...] = np.float32(factor) * x.astype(np.float32) if x.dtype.itemsize == 2 else x * factor


@dataclasses.dataclass(frozen=True)
class Steps:
    """The collectives Adasum runs on, each under a name made from `tag` (see the module docstring)."""
    exchange: object
    gather: object
    total: object

    def tagged(self, prefix):
        return Steps(lambda send, partner, tag: self.exchange(send, partner, f"{prefix}.{tag}"),
                     lambda array, tag, out: self.gather(array, f"{prefix}.{tag}", out),
                     lambda array, tag: self.total(array, f"{prefix}.{tag}"))


def _header(flat, counts):
    return np.array([flat.size, len(counts), hash(tuple(int(c) for c in counts)) % (1 << 50), 0.0], np.float64)


def _check_headers(headers, what):
    if (headers != headers[0]).any():
        raise TensorMismatchError(f"{what}: ranks differ: " + "; ".join(
            f"rank {r} has {int(h[0])} elements in {int(h[1])} tensor(s)" for r, h in enumerate(headers)))


def _everyone(mine, rank, size, steps, tag):
    """Every rank's `mine` (same length everywhere), rows in rank order: a Sum allreduce of a zero array with this
    rank's row filled (small; adding zeros is exact, also for the bytes of any dtype)."""
    rows = np.zeros((size,) + mine.shape, mine.dtype)
    rows[rank] = mine
    return steps.total(rows, tag)


def _combine(a, b, bounds):
    """a <- adasum(a, b), tensor by tensor (both on this rank)."""
    for t in range(len(bounds) - 1):
        x, y = a[bounds[t]:bounds[t + 1]], b[bounds[t]:bounds[t + 1]]
        c_a, c_b = pair_coefficients(*dot_and_norms(x, y))
        _scaled_add(x, c_a, y, c_b)


def _reduce_stacked(flat, counts, rank, size, steps, what):
    """Small inputs: every rank's vector (and header) through one allreduce, then the tree on this rank."""
    header = _header(flat, counts)
    mine = np.concatenate((header.view(np.uint8), flat.view(np.uint8)))
    try:
        rows = _everyone(mine, rank, size, steps, "stack")
    except TensorMismatchError as error:
        raise TensorMismatchError(f"{what}: the ranks' tensors differ in size (the stack holds each rank's bytes "
                                  f"after a {header.nbytes}-byte header): {error}") from None
    _check_headers(rows[:, :header.nbytes].copy().view(np.float64), what)
    vectors = [rows[r, header.nbytes:].view(flat.dtype) for r in range(size)]
    bounds = np.concatenate(([0], np.cumsum(counts, dtype=np.int64)))
    while len(vectors) > 1:          # level by level, in the dtype, as the halving path rounds
        for a, b in zip(vectors[::2], vectors[1::2]):
            _combine(a, b, bounds)
        vectors = vectors[::2]
    return vectors[0]


def reduce_flat(flat, counts, rank, size, steps, what):
    """Adasum of every rank's `flat` (1-D; the tensors of `counts` elements back to back; overwritten) over `size`
    ranks (a power of two). Returns the result (flat itself or a new 1-D array)."""
    if size == 1:
        return flat
    if size * flat.nbytes <= STACKED_BYTES:
        return _reduce_stacked(flat, counts, rank, size, steps, what)
    bounds = np.concatenate(([0], np.cumsum(counts, dtype=np.int64)))
    ntensors = len(counts)
    lo, hi, d, level = 0, flat.size, 1, 0
    work = flat
    while d < size:
        first = (hi - lo) // 2
        upper = bool(rank & d)
        keep, send = (work[first:], work[:first]) if upper else (work[:first], work[first:])
        lo, hi = (lo + first, hi) if upper else (lo, lo + first)
        received = steps.exchange(send, rank ^ d, f"l{level}")
        stats = np.zeros((ntensors, 5), np.float64)
        parts = _parts(bounds, lo, hi)
        if received.size == keep.size:          # else the shapes differ between ranks: the header says so below
            left, right = (received, keep) if upper else (keep, received)
            for t, start, stop in parts:
                stats[t] = dot_and_norms(left[start:stop], right[start:stop])
        mine = stats.reshape(-1) if level else np.concatenate((_header(flat, counts), stats.reshape(-1)))
        everyone = _everyone(mine, rank, size, steps, f"n{level}")
        if level == 0:
            _check_headers(everyone[:, :4], what)
            everyone = everyone[:, 4:]
        group = everyone[(np.arange(size) >> (level + 1)) == (rank >> (level + 1))].reshape(-1, ntensors, 5)
        for t, start, stop in parts:
            c_left, c_right = coefficients(group[:, t])
            c_keep, c_other = (c_right, c_left) if upper else (c_left, c_right)
            _scaled_add(keep[start:stop], c_keep, received[start:stop], c_other)
        work = keep
        d <<= 1
        level += 1
    ranges = final_ranges(flat.size, size)
    if all(ranges[r][1] == ranges[r + 1][0] for r in range(size - 1)):
        return steps.gather(work, "out", flat)  # the parts lie in rank order (2 ranks): gathered in place
    gathered = steps.gather(work, "out", None)
    result = np.empty_like(flat)
    offset = 0
    for start, stop in ranges:
        result[start:stop] = gathered[offset:offset + stop - start]
        offset += stop - start
    return result


def allreduce_arrays(arrays, outs, prescale_factor, postscale_factor, rank, size, steps, what):
    """Adasum of each array over the ranks, written into `outs` (None entries: new arrays); returns the outs. Arrays
    of one dtype reduce together in one pass (per-tensor dot products); each dtype is its own pass, tagged by its
    place, so the steps' names are the same on every rank."""
    kinds = {}
    for i, array in enumerate(arrays):
        kinds.setdefault(array.dtype, []).append(i)
    outs = list(outs)
    for k, positions in enumerate(kinds.values()):
        counts = [arrays[i].size for i in positions]
        flat = np.concatenate([arrays[i].reshape(-1) for i in positions])     # a copy: the inputs stay as they are
        _scale(flat, prescale_factor)
        result = reduce_flat(flat, counts, rank, size, steps.tagged(k), what)
        _scale(result, postscale_factor)
        offset = 0
        for i in positions:
            n = arrays[i].size
            piece = result[offset:offset + n].reshape(arrays[i].shape)
            if outs[i] is None:
                outs[i] = piece
            else:
                outs[i][...] = piece
            offset += n
    return outs


def start(arrays, outs, prescale_factor, postscale_factor, rank, size, steps, what, sync, single):
    """Check the arrays (on this rank, before anything is sent) and run allreduce_arrays on this thread (sync) or
    on a thread of its own, so asynchronous Adasum calls may be waited for in any order. Returns a Handle whose
    wait() gives the result (the one array when `single`, else the list)."""
    arrays = list(arrays)
    if not arrays:
        raise ValueError(f"{what}: needs at least one array")
    outs = list(outs) if outs is not None else [None] * len(arrays)
    if len(outs) != len(arrays):
        raise ValueError(f"{what}: got {len(arrays)} arrays but {len(outs)} outs")
    for i, (array, out) in enumerate(zip(arrays, outs)):
        if out is not None and (out.shape != array.shape or out.dtype != array.dtype or not out.flags.c_contiguous):
            raise ValueError(f"{what}: out {i} has shape {out.shape} {out.dtype}, input {array.shape} {array.dtype} "
                             "(outs must match and be C-contiguous)")
    check([array.dtype for array in arrays], size, what)
    handle = Handle((what,))

    def run():
        try:
            results = allreduce_arrays(arrays, outs, prescale_factor, postscale_factor, rank, size, steps, what)
        except BaseException as error:       # noqa: B902  (delivered to the waiter, whatever it is)
            handle._set_error(error)
        else:
            handle._set_result(results[0] if single else results)
    if sync:
        run()
    else:
        threading.Thread(target=run, name=f"ringtrain-{what}", daemon=True).start()
    return handle


__all__ = ["check", "reduce_flat", "final_ranges", "allreduce_arrays", "start", "Steps", "FLOAT_DTYPES",
           "STACKED_BYTES"]
