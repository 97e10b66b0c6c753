"""Average a list of gradients over all ranks: what DistributedGradientTape and ringtrain.keras's optimizer share.

Dense gradients travel in ONE host call per step (one tf.numpy_function node in a graph). It hands each bucket (up to
bucket_bytes, one dtype) to the core as one grouped allreduce -- one engine request per bucket, as torch DDP's
buckets -- and waits for all of them. The gradients reach the callback as zero-copy views of TensorFlow's buffers;
the core packs them straight into its transport's buffer (on one node the shared window itself, so packing is the
copy-in) and unpacks the result into 64-byte-aligned arrays that TensorFlow takes back without a copy. Measured
(benchmarks/results/tf_gradient_paths.txt; 2 ranks, 7.4 MB of float32 gradients in 6 tensors, CPU time per call):
grouped 2.5-2.8 ms; packing into one flat array here first and allreducing that 2.8-3.3 ms (the extra copy is
~0.7-0.9 ms); one allreduce per tensor 2.6-3.4 ms (more synchronisations). Starting each gradient's allreduce as
soon as backward produces it (a host call per gradient, then one that waits) cost MORE CPU per fit step (24-26 ms
against 20-22 ms; plain Keras 15.6 ms): on two cores there is no idle core for the overlap to use, and the extra
host calls and engine hand-offs are paid.
On one rank there is nothing to exchange: no host call at all (scales still apply).
Sparse gradients (tf.IndexedSlices) are gathered, or densified with sparse_as_dense.
None gradients stay None (as Horovod): a variable must be unconnected on every rank or on none.
"""
import numpy as np
import tensorflow as tf

import ringtrain as _core

from . import functions, shared_buckets
from .compression import Compression
from .functions import Average, global_process_set, route

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
                        prescale_factor=1.0, postscale_factor=1.0, bucket_cap_mb=25, process_set=global_process_set,
                        results_in_shared_buffers=False):
    """grads: list of tf.Tensor | tf.IndexedSlices | None (same structure on every rank of `process_set`) -> reduced
    list. results_in_shared_buffers: dense results are views of persistent buffers that the call after next
    overwrites -- only for a caller that consumes them at once (see shared_buckets.py)."""
    route(process_set)      # a set this rank is not in: the core's error now, not inside the host call
    out = list(grads)
    dense = []
    for i, grad in enumerate(grads):
        if grad is None:
            continue
        if isinstance(grad, tf.IndexedSlices):
            if not sparse_as_dense:
                out[i] = functions.allreduce(grad, op=op, name=f"{prefix}.sparse{i}", process_set=process_set)
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

    if process_set.size() == 1:
        reduced = [w * tf.cast(prescale_factor * postscale_factor, w.dtype) if scales else w for w in wires]
    else:
        def run_in_shared_buffers(*arrays):
            host = [functions._as_numpy(a) for a in arrays]
            if not all(isinstance(a, np.ndarray) for a in host):
                return run(*arrays)                  # eager GPU tensors arrive as cupy arrays: the core's path
            results = [None] * len(arrays)
            for b, bucket in enumerate(buckets):     # one at a time: fused buckets would take the copying path
                views = shared_buckets.allreduce_in_shared_buffer(
                    [host[j] for j in bucket], f"{prefix}.bucket{b}", op, prescale_factor, postscale_factor,
                    process_set)
                for j, view in zip(bucket, views):
                    results[j] = view
            return results

        def run(*arrays):
            pending = []
            for b, bucket in enumerate(buckets):
                inputs = [functions._as_numpy(arrays[j]) for j in bucket]
                pending.append((bucket, _core.grouped_allreduce_async(
                    inputs, op=op, name=f"{prefix}.bucket{b}", outs=[functions._output_like(x) for x in inputs],
                    process_set=process_set, **scales)))
            results = [None] * len(arrays)
            for bucket, handle in pending:
                for j, result in zip(bucket, handle.wait()):
                    results[j] = result
            return results

        reduced = functions.host_call(run_in_shared_buffers if results_in_shared_buffers else run, wires,
                                      [(w.dtype, w.shape) for w in wires], prefix)
    for (i, (_, ctx)), result in zip(dense, reduced):
        out[i] = compression.decompress(result, ctx)
    return out
