"""Average a list of gradients over all ranks: what DistributedGradientTape and ringtrain.keras's optimizer share.

Dense gradients travel in ONE host call (one tf.numpy_function node in a graph) that submits one grouped
allreduce per bucket (up to bucket_bytes, one dtype each) and then waits for all of them, so the engine can fuse and
pipeline the buckets while a graph holds one host-callback thread, not one per bucket. TensorFlow only hands the
gradients over once backward is finished, so unlike the torch binding there is no overlap with backward to win by
submitting buckets earlier. Sparse gradients (tf.IndexedSlices) are gathered, or densified with sparse_as_dense.
None gradients stay None (as Horovod): a variable must be unconnected on every rank or on none.
"""
import tensorflow as tf

import ringtrain as _core

from . import functions
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
        handles = []
        for b, bucket in enumerate(buckets):
            inputs = [functions._as_numpy(arrays[j]) for j in bucket]
            handles.append(_core.grouped_allreduce_async(inputs, op=op, name=f"{prefix}.bucket{b}",
                                                         outs=[functions._output_like(x) for x in inputs], **scales))
        results = [None] * len(arrays)
        for bucket, handle in zip(buckets, handles):
            for j, result in zip(bucket, handle.wait()):
                results[j] = result
        return results

    reduced = functions.host_call(run, wires, [(w.dtype, w.shape) for w in wires], prefix)
    for (i, (_, ctx)), result in zip(dense, reduced):
        out[i] = compression.decompress(result, ctx)
    return out
