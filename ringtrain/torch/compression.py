"""Gradient compression on torch tensors: Compression.none | fp16 | bf16 (the logic is ringtrain.reducer.compression's).

Same interface as Horovod's: `compress(tensor) -> (tensor, ctx)`, `decompress(tensor, ctx) -> tensor`.
"""
import torch

from ringtrain.reducer.compression import CastCompressor, Compressor, NoneCompressor  # noqa: F401  (re-exported)


class _TorchCastCompressor(CastCompressor):
    @staticmethod
    def is_floating(dtype):
        return dtype.is_floating_point

    @staticmethod
    def cast(tensor, dtype):
        return tensor.to(dtype)


class FP16Compressor(_TorchCastCompressor):
    wire_dtype = torch.float16


class BF16Compressor(_TorchCastCompressor):
    wire_dtype = torch.bfloat16


class Compression:
    """Pick one: Compression.none, Compression.fp16, Compression.bf16."""
    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
