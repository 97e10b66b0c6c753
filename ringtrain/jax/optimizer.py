"""DistributedOptimizer: an optax GradientTransformation that averages the gradients over the ranks, in buckets,
before the inner transformation sees them.

    tx = hvd.DistributedOptimizer(optax.adam(1e-3 * hvd.size()))
    opt_state = tx.init(params)
    updates, opt_state = tx.update(grads, opt_state, params)     # inside jax.jit: one host call for all buckets

The buckets, their scaling (Horovod's op / gradient_predivide_factor rule), compression, submission and completion
are ringtrain.reducer.reducer's, the object every binding shares. This module only adapts pytrees to it: the gradient
pytree's leaves are the reducer's members (in leaf order), and one host call (host_call.py; an XLA FFI custom call
under jit on CPU) hands all of them to the reducer. Under jit each bucket is one grouped allreduce from XLA's input
buffers into its output buffers (the same buffers: the call's outputs alias its inputs), which the shm transport
reduces where they lie; eagerly, each bucket is packed into its own persistent flat buffer in the shared-memory
window (ringtrain.empty_shared) and allreduced there. In jit every gradient is final at once, so there is no overlap
with backward to win: buckets are planned by size (Layout.BY_SIZE), and a single bucket takes the engine's
one-cycle express path. Measured at 2 ranks on the 3.7 MB MLP of benchmarks/jax_scaling.py, one bucket (one
agreement cycle) beat reducing its three arrays of 1 MB and more alone (four cycles).
"""
import jax
import numpy as np
import optax

from ringtrain.core import shared_arrays
from ringtrain.ops import Adasum, Average
from ringtrain.core.process_sets import global_process_set
from ringtrain.reducer.reducer import Member, Reducer, Scaling, instance_prefix

from .host_call import collective_primitive, same_avals


class PytreeReducer:
    """One ringtrain.reducer.reducer.Reducer for one gradient pytree layout (structure, shapes, dtypes): the binding state
    of a DistributedOptimizer, beside it rather than on the user's transformation."""

    def __init__(self, paths, avals, *, scaling, compression, process_set, bucket_bytes):
        members = [Member(i, path, int(np.prod(a.shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize,
                          kind=(np.dtype(a.dtype), "cpu"))
                   for i, (path, a) in enumerate(zip(paths, avals))]
        self.reducer = Reducer(members, prefix=instance_prefix("DistributedOptimizer", process_set),
                               scaling=scaling, compression=compression, process_set=process_set,
                               bucket_bytes=bucket_bytes, first_bucket_bytes=bucket_bytes, overlap=False)
        self.shapes = [tuple(a.shape) for a in avals]

    def reduce(self, *gradients):
        """Host side, returning the results (views of the buckets): every leaf arrives, each completed bucket is
        submitted, then all are waited for."""
        return self._run(gradients, None, sync=len(self.reducer.buckets) == 1)

    def reduce_into(self, gradients, outputs):
        """Host side with the results written into `outputs` (XLA's output buffers, under jit with the FFI
        lowering). Every bucket runs on this thread in bucket order (the engine's express path, one agreement
        cycle each) as one grouped allreduce from XLA's input buffers into its output buffers, which the transport
        reads and writes where they lie: it copies in only the part its peers read and copies out only the part
        they reduced (for 2 ranks: half the data each way, where packing into a bucket and copying the result out
        copies all of it twice)."""
        self._run(gradients, outputs, sync=True)

    def _run(self, gradients, outputs, sync):
        reducer, results = self.reducer, [None] * len(gradients)
        reducer.prepare_for_backward()
        for i in range(len(gradients)):
            bucket = reducer.arrived(i)
            if bucket is not None:
                self._submit(bucket, gradients, outputs, results, sync)
        reducer.finalize(launch_remaining=lambda bucket: self._submit(bucket, gradients, outputs, results, sync))
        return results

    def _submit(self, bucket, gradients, outputs, results, sync):
        keys = bucket.keys
        if outputs is None and self.reducer.scaling.op is Adasum:
            # Adasum's dot products are per tensor: the bucket travels as its list of gradients, never packed
            outputs = results
            for k in keys:
                results[k] = np.empty_like(gradients[k])
        if outputs is not None:      # XLA's buffers as they are (one array: an allreduce from input into output)
            self.reducer.submit(bucket, [gradients[k] for k in keys], outs=[outputs[k] for k in keys], sync=True)
            return
        if bucket.buffer is None:
            # in the shm window: an in-place allreduce of it is read by peers where it lies (no copy in or out)
            bucket.buffer = shared_arrays.empty_shared(sum(gradients[k].size for k in keys), gradients[keys[0]].dtype)
            bounds = np.cumsum([0] + [gradients[k].size for k in keys])
            bucket.views = [bucket.buffer[a:b].reshape(self.shapes[k]) for k, a, b in zip(keys, bounds, bounds[1:])]
        for k, view in zip(keys, bucket.views):
            view[...] = gradients[k]          # packing is the copy-in: the inputs are XLA's read-only buffers
            results[k] = view
        self.reducer.submit(bucket, [bucket.buffer], sync=sync)


def _reduce(*gradients, spec):
    return spec.reduce(*gradients)


def _reduce_into(gradients, outputs, spec):
    spec.reduce_into(gradients, outputs)


# The reduction is one custom call per update whose input is this step's gradients and whose output feeds the
# update, so its data orders it: one step's reduction can only run after the previous step's update. By default it
# carries no ordering token (no JAX effect): JAX dispatches a jitted step that holds an ordered effect through its
# slower Python path, handing a runtime token from each call to the next -- measured at 2 ranks on 2 cores, the MLP
# of benchmarks/jax_scaling.py trained at 226 steps/s with the token and 269 without it
# (benchmarks/results/jax_scaling_cpu_2ranks_abba_1.txt). Among other ringtrain collectives of the same jitted
# function it runs where XLA's schedule puts it, which is the same on every rank, since every rank compiles the same
# program. ordered=True threads the token through it as well.
# in_place: the reduced gradients go back into XLA's gradient buffers (the transport reads each block before it
# writes that block's result), so XLA allocates no fresh 3.7 MB of outputs every step.
reduce_gradients_p = collective_primitive("ringtrain_reduce_gradients", _reduce, same_avals, _reduce_into,
                                          ordered=False, in_place=True)
ordered_reduce_gradients_p = collective_primitive("ringtrain_reduce_gradients_ordered", _reduce, same_avals,
                                                  _reduce_into, in_place=True)


class DistributedGradientTransformation(optax.GradientTransformation):
    """optax's (init, update) pair; `reducers` is the binding state (one PytreeReducer per gradient layout)."""


def DistributedOptimizer(optimizer, op=Average, gradient_predivide_factor=1.0, compression=None,
                         bucket_bytes=64 << 20, process_set=global_process_set, ordered=False):
    """Wrap an optax GradientTransformation: update() averages the gradients over the set's ranks (op=Sum sums
    them, op=Adasum combines them by Adasum's rule, tensor by tensor), in buckets of up to `bucket_bytes`, then runs `optimizer.update`. `compression` (Compression.fp16 /
    bf16) casts floating gradients for the wire. Scale the learning rate by size() (the linear-scaling rule).

    The reduction is ordered by its data (this step's gradients in, the update out). `ordered=True` also keeps it
    in program order among other ringtrain collectives of the same jitted function, with JAX's ordering token,
    which makes JAX dispatch every such jitted step through its slower path (measured on a 2-core machine at 2
    ranks: 226 instead of 269 steps/s for a 3.7 MB MLP)."""
    scaling = Scaling.for_gradients(op, gradient_predivide_factor)
    primitive = ordered_reduce_gradients_p if ordered else reduce_gradients_p
    reducers = {}

    def reducer_for(leaves, paths):
        key = tuple((tuple(x.shape), np.dtype(x.dtype)) for x in leaves), tuple(paths)
        if key not in reducers:
            reducers[key] = PytreeReducer(paths, leaves, scaling=scaling, compression=compression,
                                          process_set=process_set, bucket_bytes=bucket_bytes)
        return reducers[key]

    def average(updates):
        path_leaves, tree = jax.tree_util.tree_flatten_with_path(updates)
        if not path_leaves:
            return updates
        paths = [jax.tree_util.keystr(p) for p, _ in path_leaves]
        compressed = [compression.compress(x) if compression is not None else (x, None) for _, x in path_leaves]
        wires = [jax.numpy.asarray(w) for w, _ in compressed]
        reduced = primitive.bind(*wires, spec=reducer_for(wires, paths))
        if compression is not None:
            reduced = [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, compressed)]
        return jax.tree_util.tree_unflatten(tree, list(reduced))

    def update(updates, state, params=None, **extra_args):
        return optimizer.update(average(updates), state, params, **extra_args)

    transformation = DistributedGradientTransformation(optimizer.init, update)
    transformation.reducers = reducers
    return transformation
