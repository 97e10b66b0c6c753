"""Gradient compression for the wire, framework-free: the bindings give the wire dtypes and how their tensors cast.

Horovod's interface: `compress(tensor) -> (tensor, ctx)`, `decompress(tensor, ctx) -> tensor`. A cast compressor
sends floating tensors as 16 bits and casts them back after the allreduce: half the bytes on bandwidth-bound steps,
for 16-bit rounding of the summed gradient (fp16: 11-bit mantissa, range +-65504; bf16: 8-bit mantissa, float32's
range, so no overflow on large sums). Integers and tensors already in the wire dtype pass through untouched.
"""


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


class CastCompressor(Compressor):
    """Casts floating tensors to `wire_dtype`. A binding subclasses it with `is_floating(dtype)` and
    `cast(tensor, dtype)` for its tensors, and one subclass per wire dtype."""
    wire_dtype = None

    @staticmethod
    def is_floating(dtype):
        raise NotImplementedError

    @staticmethod
    def cast(tensor, dtype):
        raise NotImplementedError

    @classmethod
    def compress(cls, tensor):
        original = tensor.dtype
        if cls.is_floating(original) and original != cls.wire_dtype:
            tensor = cls.cast(tensor, cls.wire_dtype)
        return tensor, original

    @classmethod
    def decompress(cls, tensor, ctx):
        return tensor if ctx is None or tensor.dtype == ctx else cls.cast(tensor, ctx)


class CommunicationHook:
    """The Reducer's one communication seam: what a bucket's tensors become on the wire (encode, before the
    collective) and what the reduced wire tensors become again (decode, after it). Today it runs a Compressor's
    cast; a hook that changes what is communicated (PowerSGD's low-rank factors, Adasum's deltas) implements the
    same two methods and is given to the Reducer instead."""

    def __init__(self, compressor=None):
        self.compressor = compressor

    @classmethod
    def of(cls, compression):
        """The hook of a binding's `compression=` argument: a Compressor (class or instance) or a hook itself."""
        return compression if isinstance(compression, CommunicationHook) else cls(compression)

    def encode(self, tensor):
        """(wire tensor, context for decode)."""
        return self.compressor.compress(tensor) if self.compressor is not None else (tensor, None)

    def decode(self, tensor, ctx):
        return self.compressor.decompress(tensor, ctx) if self.compressor is not None else tensor
