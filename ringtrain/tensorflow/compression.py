"""Gradient compression on tf tensors: Compression.none | fp16 | bf16 (the logic is ringtrain.reducer.compression's)."""
import tensorflow as tf

from ringtrain.reducer.compression import CastCompressor, Compressor, NoneCompressor  # noqa: F401  (re-exported)


class _TFCastCompressor(CastCompressor):
    @staticmethod
    def is_floating(dtype):
        return dtype.is_floating

    @staticmethod
    def cast(tensor, dtype):
        return tf.cast(tensor, dtype)


class FP16Compressor(_TFCastCompressor):
    wire_dtype = tf.float16


class BF16Compressor(_TFCastCompressor):
    wire_dtype = tf.bfloat16


class Compression:
    """Pick one: Compression.none, Compression.fp16, Compression.bf16."""
    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
