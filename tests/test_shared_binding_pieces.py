"""The framework-free pieces the torch and TF bindings share: ops.resolve_op (Horovod's op= / average=) and
compression.CastCompressor (a binding only says how its tensors cast; here numpy arrays stand in)."""
import numpy as np
import pytest

from ringtrain.reducer.compression import CastCompressor, Compressor
from ringtrain.ops import Average, Max, Sum, resolve_op


@pytest.mark.parametrize("op, average, expected", [(None, None, Average), (None, True, Average), (None, False, Sum),
                                                   ("max", False, Max), (Sum, True, Sum)])
def test_resolve_op_prefers_op_then_the_average_flag(op, average, expected):
    assert resolve_op(op, average) is expected


class NumpyFP16Compressor(CastCompressor):
    wire_dtype = np.dtype(np.float16)

    @staticmethod
    def is_floating(dtype):
        return dtype.kind == "f"

    @staticmethod
    def cast(array, dtype):
        return array.astype(dtype)


def test_cast_compressor_round_trip_and_what_passes_through():
    x = np.array([1.0, 2.5, -3.25])
    wire, ctx = NumpyFP16Compressor.compress(x)
    assert wire.dtype == np.float16 and ctx == np.float64
    back = NumpyFP16Compressor.decompress(wire, ctx)
    assert back.dtype == np.float64
    np.testing.assert_array_equal(back, x)
    for untouched in (np.array([1, 2], np.int32), np.ones(2, np.float16)):     # integers, the wire dtype itself
        wire, ctx = NumpyFP16Compressor.compress(untouched)
        assert wire is untouched and NumpyFP16Compressor.decompress(wire, ctx) is untouched
    wire, ctx = Compressor.compress(x)
    assert wire is x and ctx is None and Compressor.decompress(wire, ctx) is x
