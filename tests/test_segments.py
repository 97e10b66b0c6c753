"""Segments: several flat arrays read as one buffer by a transport (no copy), checked against their concatenation."""
import numpy as np
import pytest

from ringtrain.transports.segments import Segments, fill, runs

SIZES = (5, 1, 7, 3)


def arrays():
    return [np.arange(n, dtype=np.float32) + 100 * i for i, n in enumerate(SIZES)]


def test_slices_are_views_and_equal_the_concatenation():
    parts = arrays()
    seg, flat = Segments(parts), np.concatenate(parts)
    assert (seg.size, seg.nbytes, seg.itemsize, seg.dtype) == (16, 64, 4, np.float32)
    assert seg.reshape(-1) is seg
    for lo in range(seg.size + 1):
        for hi in range(lo, seg.size + 1):
            part = seg[lo:hi]
            got = np.empty(hi - lo, np.float32)
            fill(got, part)
            np.testing.assert_array_equal(got, flat[lo:hi], err_msg=f"[{lo}:{hi}]")
    inside = seg[6:9]                               # within the third array: an ndarray view of it
    assert isinstance(inside, np.ndarray) and np.shares_memory(inside, parts[2])
    inside[...] = -1
    assert parts[2][:3].tolist() == [-1, -1, -1]
    assert isinstance(seg[4:7], Segments)          # across arrays
    with pytest.raises(ValueError):
        seg.reshape(4, 4)


def test_runs_cover_everything_in_pieces_that_never_cross_an_array():
    seg = Segments(arrays())
    starts = set(seg.starts)
    for limit in (1, 2, 4, 100):
        for lo, hi in ((0, 16), (3, 14), (6, 7)):
            pieces = seg.runs(lo, hi, limit)
            assert pieces[0][0] == lo and pieces[-1][1] == hi
            assert all(a < b <= a + limit for a, b in pieces)
            assert all(p[1] == q[0] for p, q in zip(pieces, pieces[1:]))
            assert all(isinstance(seg[a:b], np.ndarray) for a, b in pieces)
            # a piece ends at every array boundary inside the range
            assert {s for s in starts if lo < s < hi} <= {b for _, b in pieces}
    assert runs(np.zeros(10), 4) == [(0, 4), (4, 8), (8, 10)]


def test_fill_in_every_direction():
    parts, flat = arrays(), np.arange(16, dtype=np.float32) * 3
    seg = Segments(parts)
    fill(seg, flat)
    np.testing.assert_array_equal(np.concatenate(parts), flat)
    other = [np.zeros(n, np.float32) for n in SIZES]
    fill(Segments(other)[2:13], seg[2:13])
    np.testing.assert_array_equal(np.concatenate(other)[2:13], flat[2:13])
    assert np.concatenate(other)[:2].tolist() == [0, 0]
    out = np.empty(16, np.float32)
    fill(out, seg)
    np.testing.assert_array_equal(out, flat)
