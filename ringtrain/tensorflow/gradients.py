"""Average a list of gradients over all ranks: what DistributedGradientTape and ringtrain.keras's optimizer share,
through the framework-neutral ringtrain.reducer.reducer (bucket plan, names, scaling, submission and completion).

Dense gradients travel in ONE host call per step (one asynchronous op in a graph, host_op.py). It hands each bucket (up to
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
import functools

import numpy as np
import tensorflow as tf

from ringtrain.ops import as_allreduce_op
from ringtrain.reducer.reducer import Member, Reducer, Scaling

from . import functions, shared_buckets
from .compression import Compression
from .functions import Adasum, Average, global_process_set, route

_MB = 1 << 20


def _nbytes(tensor):
    count = tensor.shape.num_elements()
    return (count if count is not None else 1) * tensor.dtype.size


def gradient_members(wires):
    """The reducer's view of a list of wire tensors: key = position, kind = dtype (all on the host call's side)."""
    return [Member(i, f"gradient{i}", _nbytes(w), w.dtype) for i, w in enumerate(wires)]


class GradientReducer:
    """The TF side of the reducer for one DistributedGradientTape or keras DistributedOptimizer: it compresses,
    plans (one Reducer per gradient structure, cached), and runs every bucket of a step in ONE host call.
    results_in_shared_buffers: dense results are views of persistent buffers that the call after next overwrites --
    only for a caller that consumes them at once (see shared_buckets.py)."""

    def __init__(self, scaling=Scaling(), compression=Compression.none, sparse_as_dense=False, bucket_cap_mb=25,
                 process_set=global_process_set, results_in_shared_buffers=False):
        self.scaling = scaling
        self.compression = compression
        self.sparse_as_dense = bool(sparse_as_dense)
        self.bucket_bytes = int(bucket_cap_mb * _MB)
        self.process_set = process_set
        self.results_in_shared_buffers = bool(results_in_shared_buffers)
        self._reducers = {}     # (prefix, wire dtypes and shapes) -> Reducer

    def reducer_for(self, prefix, wires):
        key = (prefix, tuple((w.dtype, tuple(w.shape)) for w in wires))
        reducer = self._reducers.get(key)
        if reducer is None:
            # reduced after backward, in one host call: ordered by size, not by when gradients became final
            reducer = self._reducers[key] = Reducer(
                gradient_members(wires), prefix=prefix, scaling=self.scaling, compression=self.compression,
                process_set=self.process_set, bucket_bytes=self.bucket_bytes, first_bucket_bytes=self.bucket_bytes,
                overlap=False)
        return reducer

    @tf.autograph.experimental.do_not_convert
    def __call__(self, grads, prefix):
        """grads: list of tf.Tensor | tf.IndexedSlices | None (same structure on every rank of the process set) ->
        reduced list."""
        route(self.process_set)   # a set this rank is not in: the core's error now, not inside the host call
        out = list(grads)
        dense = []
        for i, grad in enumerate(grads):
            if grad is None:
                continue
            if isinstance(grad, tf.IndexedSlices):
                # without a dense_shape there is no dense form: gathered either way (as Horovod's allreduce)
                if not self.sparse_as_dense or grad.dense_shape is None:
                    out[i] = functions.allreduce(grad, op=self.scaling.op, name=f"{prefix}.sparse{i}",
                                                 process_set=self.process_set)
                    continue
                grad = tf.convert_to_tensor(grad)
            dense.append((i, self.compression.compress(grad)))
        if not dense:
            return out
        wires = [wire for _, (wire, _) in dense]
        reducer = self.reducer_for(prefix, wires)
        if self.process_set.size() == 1:
            factor = reducer.scaling.local_factor()
            reduced = [w * tf.cast(factor, w.dtype) if factor != 1.0 else w for w in wires]
        else:
            run = functools.partial(_run_in_shared_buffers if self.results_in_shared_buffers else _run, reducer)
            reduced = functions.host_call(run, wires, [(w.dtype, w.shape) for w in wires], prefix)
        for (i, (_, ctx)), result in zip(dense, reduced):
            out[i] = self.compression.decompress(result, ctx)
        return out


def allreduce_gradients(grads, prefix, compression=Compression.none, op=Average, sparse_as_dense=False,
                        prescale_factor=1.0, postscale_factor=1.0, bucket_cap_mb=25, process_set=global_process_set,
                        results_in_shared_buffers=False):
    """One call of a GradientReducer with these options (any scale factors, not only a predivide's)."""
    reducer = GradientReducer(Scaling(as_allreduce_op(op), prescale_factor, postscale_factor), compression,
                              sparse_as_dense, bucket_cap_mb, process_set, results_in_shared_buffers)
    return reducer(grads, prefix)


def _run(reducer, *arrays):
    """The host call: every bucket submitted (one grouped allreduce each), then all waited for."""
    results = [None] * len(arrays)

    def launch(bucket):
        inputs = [functions.as_host_array(arrays[j]) for j in bucket.keys]
        outs = [functions.output_like(x) for x in inputs]
        reducer.submit(bucket, inputs, outs=outs, done=functools.partial(_place, results, bucket.keys))
    reducer.prepare_for_backward()
    reducer.finalize(launch_remaining=launch)       # every bucket, in bucket order, then all waited for
    return results


def _place(results, positions, reduced):
    for j, result in zip(positions, reduced if isinstance(reduced, list) else [reduced]):
        results[j] = result


def _run_in_shared_buffers(reducer, *arrays):
    host = [functions.as_host_array(a) for a in arrays]
    if not all(isinstance(a, np.ndarray) for a in host) or reducer.scaling.op is Adasum:
        # eager GPU tensors arrive as cupy arrays: the core's path; Adasum's dot products are per tensor, so its
        # buckets travel as lists of tensors, never packed into one buffer
        return _run(reducer, *arrays)
    results = [None] * len(arrays)
    scaling = reducer.scaling

    def launch(bucket):                        # one at a time: fused buckets would take the copying path
        buffer, views = shared_buckets.stage([host[j] for j in bucket.keys], bucket.name,
                                             scaling.prescale_factor, reducer.process_set)
        # the prescale was applied while copying in: one array, no prescale, is the core's copy-free path
        reducer.submit(bucket, [buffer], sync=True, prescaled=True)
        _place(results, bucket.keys, views)
    reducer.prepare_for_backward()
    reducer.finalize(launch_remaining=launch)
    return results
