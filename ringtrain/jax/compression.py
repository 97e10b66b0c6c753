"""Gradient compression on jax.Arrays: Compression.none | fp16 | bf16 (the logic is ringtrain.reducer.compression's)."""
import jax.numpy as jnp

from ringtrain.reducer.compression import CastCompressor, Compressor, NoneCompressor  # noqa: F401  (re-exported)


class _JaxCastCompressor(CastCompressor):
    @staticmethod
    def is_floating(dtype):
        return jnp.issubdtype(dtype, jnp.floating)

    @staticmethod
    def cast(tensor, dtype):
        return tensor.astype(dtype)


class FP16Compressor(_JaxCastCompressor):
    wire_dtype = jnp.dtype(jnp.float16)


class BF16Compressor(_JaxCastCompressor):
    wire_dtype = jnp.dtype(jnp.bfloat16)


class Compression:
    """Pick one: Compression.none, Compression.fp16, Compression.bf16."""
    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
