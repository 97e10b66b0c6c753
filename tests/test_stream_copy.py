"""The non-temporal writes (ringtrain/stream_copy.py, csrc/stream_copy.c) against numpy, bit for bit: every size
around the vector and alignment boundaries, every start offset of the destination, 1-3 peer regions, scales."""
import os

import numpy as np
import pytest

from ringtrain import stream_copy

if not stream_copy.available():
    if os.environ.get("RINGTRAIN_REQUIRE_EXTRAS") == "1":
        raise RuntimeError(f"the stream-copy module is required here (RINGTRAIN_REQUIRE_EXTRAS=1): "
                           f"{stream_copy.library()}")
    pytest.skip(f"no stream-copy module: {stream_copy.library()}", allow_module_level=True)


SIZES = [0, 1, 3, 7, 8, 9, 31, 33, 63, 64, 65, 127, 129, 300, 1001]


def test_copy_equals_numpy_at_every_size_and_offset():
    rng = np.random.default_rng(0)
    for n in SIZES + [70001]:
        src_raw = rng.integers(0, 256, n + 64, dtype=np.uint8)
        for dst_off in range(0, 40, 3):
            for src_off in (0, 5):
                src = src_raw[src_off: src_off + n]
                raw = np.zeros(n + 80, np.uint8)
                dst = raw[dst_off: dst_off + n]
                stream_copy.copy(dst, src)
                assert np.array_equal(dst, src), (n, dst_off, src_off)
                assert not raw[:dst_off].any() and not raw[dst_off + n:].any(), (n, dst_off, "wrote outside dst")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_reduce_push_equals_numpy_adds_in_order_then_the_scale(dtype):
    rng = np.random.default_rng(1)
    itemsize = np.dtype(dtype).itemsize
    for n in SIZES + [4099]:
        for regions in (1, 2, 3):
            for scale in (1.0, 0.5, 1 / 3):
                own = rng.standard_normal(n + 8).astype(dtype)[1:n + 1]          # start off any boundary
                peers = [rng.standard_normal(n).astype(dtype) * 10 ** k for k in range(regions)]
                want = own.copy()
                for p in peers:
                    want = np.add(want, p)
                if scale != 1.0:
                    want = np.multiply(want, np.asarray(scale, dtype=dtype))
                for shift in (0, 1, 3):                                           # dst alignments
                    raw = np.full(n + 8, -7, dtype)
                    dst = raw[shift: shift + n]
                    copies = [p.copy() for p in peers]
                    stream_copy.reduce_push(dst, own, copies, scale)
                    what = (n, regions, scale, shift, itemsize)
                    assert np.array_equal(dst, want), what
                    assert all(np.array_equal(c, want) for c in copies), what
                    assert (raw[:shift] == -7).all() and (raw[shift + n:] == -7).all(), what


def test_reduce_push_refuses_what_it_cannot_do():
    module = stream_copy.library()
    a = np.zeros(10, np.float32)
    with pytest.raises(ValueError, match="reduce_push"):
        module.reduce_push(0, a.view(np.uint8), a.view(np.uint8), (np.zeros(9, np.float32).view(np.uint8),), 1.0)
    with pytest.raises(ValueError, match="reduce_push"):
        module.reduce_push(5, a.view(np.uint8), a.view(np.uint8), (a.copy().view(np.uint8),), 1.0)
    with pytest.raises(ValueError, match="reduce_push"):
        module.reduce_push(0, a.view(np.uint8), a.view(np.uint8), (), 1.0)
    with pytest.raises(ValueError, match="stream copy"):
        module.copy(a.view(np.uint8), np.zeros(11, np.float32).view(np.uint8))
    assert stream_copy.reduces(np.dtype(np.float32)) and not stream_copy.reduces(np.dtype(np.int32))
