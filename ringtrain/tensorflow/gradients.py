"""Average a list of gradients over all ranks: what DistributedGradientTape and ringtrain.keras's optimizer share.

Dense gradients travel in ONE host call (one tf.numpy_function node in a graph). It packs each bucket (up to
bucket_bytes, one dtype) into one flat 64-byte-aligned buffer, as torch DDP's buckets, submits one in-place allreduce
per bucket and then waits for all of them: the engine pays its per-request cost once per bucket instead of once per
tensor (measured at 1 rank here: 6 small arrays as a grouped allreduce ~0.9 ms, one array ~0.07 ms), and a graph
holds one host-callback thread, not one per bucket. The reduced gradients come back as views of the flat buffer,
each starting on a 64-byte boundary, so TensorFlow can take them without another copy. TensorFlow only hands the
gradients over once backward is finished, so unlike the torch binding there is no overlap with backward to win by
submitting buckets earlier. Sparse gradients (tf.IndexedSlices) are gathered, or densified with sparse_as_dense.
None gradients stay None (as Horovod): a variable must be unconnected on every rank or on none.
"""
import numpy as np
import tensorflow as tf

import ringtrain as _core

from . import functions
from .arrays import TF_ALIGNMENT, aligned_empty
from .compression import Compression
from .functions import Average

_MB = 1 << 20


def layout_buckets(nbytes_and_dtypes, bucket_bytes):
    """Consecutive index buckets of at most bucket_bytes (a larger single tensor gets its own), one dtype each."""
    buckets, current, current_bytes = [], [], 0
    for index, (nbytes, dtype) in enumerate(nbytes_and_dtypes):
        if current and (current_bytes + nbytes > bucket_bytes or dtype != nbytes_and_dtypes[current[0]][1]):
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(index)
        current_bytes += nbytes
    if current:
        buckets.append(current)
    return buckets


def pack(arrays):
    """(flat buffer holding copies of `arrays`, views of it shaped like them); every view starts 64-byte aligned."""
    dtype = arrays[0].dtype
    step = max(1, TF_ALIGNMENT // dtype.itemsize)
    offsets, total = [], 0
    for array in arrays:
        offsets.append(total)
        total += -(-array.size // step) * step
    flat = aligned_empty((total,), dtype)
    views = []
    for array, offset in zip(arrays, offsets):
        view = flat[offset:offset + array.size]
        view[...] = array.reshape(-1)
        views.append(view.reshape(array.shape))
    return flat, views


def _nbytes(tensor):
    count = tensor.shape.num_elements()
    return (count if count is not None else 1) * tensor.dtype.size


@tf.autograph.experimental.do_not_convert
def allreduce_gradients(grads, prefix, compression=Compression.none, op=Average, sparse_as_dense=False,
                        prescale_factor=1.0, postscale_factor=1.0, bucket_cap_mb=25):
    """grads: list of tf.Tensor | tf.IndexedSlices | None (same structure on every rank) -> reduced list."""
    out = list(grads)
    dense = []
    for i, grad in enumerate(grads):
        if grad is None:
            continue
        if isinstance(grad, tf.IndexedSlices):
            if not sparse_as_dense:
                out[i] = functions.allreduce(grad, op=op, name=f"{prefix}.sparse{i}")
                continue
            grad = tf.convert_to_tensor(grad)
        dense.append((i, compression.compress(grad)))
    if not dense:
        return out
    wires = [wire for _, (wire, _) in dense]
    buckets = layout_buckets([(_nbytes(w), w.dtype) for w in wires], int(bucket_cap_mb * _MB))
    scales = {}
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        scales = dict(prescale_factor=prescale_factor, postscale_factor=postscale_factor)

    def run(*arrays):
        pending = []
        for b, bucket in enumerate(buckets):
            inputs = [functions._as_numpy(arrays[j]) for j in bucket]
            name = f"{prefix}.bucket{b}"
            if all(isinstance(x, np.ndarray) for x in inputs):
                flat, views = pack(inputs)
                pending.append((bucket, views, _core.allreduce_async(flat, op=op, name=name, out=flat, **scales)))
            else:   # GPU (cupy) gradients: the core's grouped allreduce packs them with its own kernels
                pending.append((bucket, None, _core.grouped_allreduce_async(
                    inputs, op=op, name=name, outs=[functions._output_like(x) for x in inputs], **scales)))
        results = [None] * len(arrays)
        for bucket, views, handle in pending:
            reduced = handle.wait()
            for j, result in zip(bucket, views if views is not None else reduced):
                results[j] = result
        return results

    reduced = functions.host_call(run, wires, [(w.dtype, w.shape) for w in wires], prefix)
    for (i, (_, ctx)), result in zip(dense, reduced):
        out[i] = compression.decompress(result, ctx)
    return out
