"""Gradient compression for the wire, on tf tensors: cast floating tensors to 16 bits before the allreduce, back after.

Same interface as Horovod's and ringtrain.torch's: `compress(tensor) -> (tensor, ctx)`, `decompress(tensor, ctx)`.
fp16: 11-bit mantissa, range +-65504; bf16: 8-bit mantissa, float32's range (no overflow on large sums).
"""
import tensorflow as tf


class Compressor:
    """No-op base: the tensor goes over the wire as it is."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class NoneCompressor(Compressor):
    pass


class _CastCompressor(Compressor):
    wire_dtype = None

    @classmethod
    def compress(cls, tensor):
        """Cast floating tensors to the wire dtype; integers and the wire dtype itself pass through untouched."""
        original = tensor.dtype
        if original.is_floating and original != cls.wire_dtype:
            tensor = tf.cast(tensor, cls.wire_dtype)
        return tensor, original

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None or tensor.dtype == ctx else tf.cast(tensor, ctx)


class FP16Compressor(_CastCompressor):
    wire_dtype = tf.float16


class BF16Compressor(_CastCompressor):
    wire_dtype = tf.bfloat16


class Compression:
    """Pick one: Compression.none, Compression.fp16, Compression.bf16."""
    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
