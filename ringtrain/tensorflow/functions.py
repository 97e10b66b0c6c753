"""The core API on tf tensors, with Horovod's names: eagerly, inside tf.function, and differentiable.

Eagerly, a tensor goes to the core as a zero-copy numpy view (GPU: a cupy view through DLPack) and the result comes
back without a copy where TF allows it (see arrays.py). In a graph (tf.function, tf.compat.v1) each collective is
one asynchronous op with declared output dtypes and shapes (host_op.py): it returns TF's executor thread at once and
runs the collective on a ringtrain thread, so independent collectives may run in any order on each rank. Under XLA
(jit_compile=True) host ops cannot run: see ringtrain.keras.xla. Rank disagreements raise
tf.errors.FailedPreconditionError, as Horovod.

Gradients (tf.custom_gradient) are ringtrain.reducer.gradient_rules' table, Horovod's rules shared with ringtrain.torch, with
the loss understood as each rank's own loss: allreduce -> allreduce of the gradient with the same op and scales;
allgather -> this rank's rows of the gradient averaged over ranks; broadcast -> the averaged gradient on the root,
zeros elsewhere; alltoall -> the reverse alltoall; reducescatter -> allgather of the gradient (times the set's size
for op=Sum).

Auto names (name=None) must be the same on every rank: eagerly they count calls ("tf.allreduce.7", per process set:
"tf.allreduce.set2.3"); in a graph they come from the input tensor's graph name ("tf.allreduce.dense/MatMul:0"),
which does not depend on how many functions a rank happened to trace before.

Every collective takes `process_set=` (default: all ranks), as Horovod: only the set's ranks call it, a
broadcast's root_rank is a world rank, allgather / alltoall / reducescatter order blocks by rank within the set, and
the gradients' rules use the set's size and rank.

    import ringtrain.tensorflow as hvd
    hvd.init()
    total = hvd.allreduce(tf.constant([float(hvd.rank())]), op=hvd.Sum)   # [0 + 1 + ... + size-1]
"""
import collections
import re
import weakref

import numpy as np
import tensorflow as tf
from tensorflow.python.autograph.impl import api as autograph_api
from tensorflow.python.eager import context, record
from tensorflow.python.framework.ops import EagerTensor

from ringtrain.core import collectives
from ringtrain.reducer import gradient_rules
from ringtrain.core import names
from ringtrain.core.build_info import (ccl_built, cuda_built, ddl_built, gloo_built, gloo_enabled,  # noqa: F401
                                  mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rocm_built)
# lifecycle, topology, control and object collectives need no tensors: the core's own functions, re-exported under
# Horovod's names (broadcast_object / allgather_object use pickle: trusted peers only)
from ringtrain.core.collectives import allgather_object, barrier, broadcast_object, join  # noqa: F401
from ringtrain.core.state import is_homogeneous, start_timeline, stop_timeline  # noqa: F401  (re-exported)
from ringtrain.core.state import (cross_rank, cross_size, init, is_initialized, local_rank,  # noqa: F401
                                  local_size, rank, shutdown, size)
from ringtrain.ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum, as_op  # noqa: F401  (re-exported)
from ringtrain.ops import resolve_op
from ringtrain.errors import TensorMismatchError, UnsupportedOperationError
from ringtrain.core.process_sets import (ProcessSet, add_process_set, global_process_set,  # noqa: F401  (re-exported)
                                    process_sets, remove_process_set, route)

from . import arrays, host_op, xla
from .compression import Compression

# ---------------------------------------------------------------- names and host calls

EAGER_POOLED_BYTES = 256 << 10      # eager results from here up come from the core's result pool (aligned there)

_graph_counts = weakref.WeakKeyDictionary()   # graph -> names used in it (a name twice in one graph gets .2, .3)


# our functions branch on Python values only; autograph would just slow tracing down
_no_autograph = tf.autograph.experimental.do_not_convert


def _auto_name(kind, name, tensor, process_set=global_process_set):
    """Also the early check every collective passes: a set this rank is not in raises here, at trace time, with the
    core's message (shapes below use the set's rank)."""
    route(process_set)
    if name is not None:
        return name
    if process_set.process_set_id:
        kind = f"{kind}.set{process_set.process_set_id}"   # eager counts per set: members agree on them
    if tf.executing_eagerly():     # counted with the core's auto names: init() restarts both
        return f"tf.{kind}.{names.next_number('tf.' + kind)}"
    base = f"tf.{kind}.{tensor.name}"
    counts = _graph_counts.setdefault(tensor.graph, collections.Counter())
    counts[base] += 1
    return base if counts[base] == 1 else f"{base}.{counts[base]}"


def _node_name(name):
    """A valid TF op name derived from the collective's name (graph readability only)."""
    return "ringtrain_" + re.sub(r"[^A-Za-z0-9_.\-/]", "_", name)[:200]


def host_call(fn, inputs, out_specs, name):
    """Run fn(*arrays) -> list of arrays on `inputs`: eagerly on zero-copy views, in a graph as one asynchronous op
    (host_op; tf.numpy_function where it cannot be built) whose outputs get the declared (dtype, shape) of out_specs."""
    if tf.executing_eagerly():
        try:
            results = fn(*[arrays.to_array(t) for t in inputs])
        except TensorMismatchError as e:     # Horovod's type (tf.errors.FailedPreconditionError), ours too
            raise host_op.as_tf_error(e) from None
        return [arrays.to_tensor(r) for r in results]
    xla.check_not_compiling(f"ringtrain collective {name!r}")
    dtypes = [tf.as_dtype(dtype) for dtype, _ in out_specs]
    outputs = host_op.call(fn, inputs, dtypes, _node_name(name))
    if outputs is None:       # the op could not be built (host_op warned): in order only
        outputs = tf.numpy_function(fn, list(inputs), dtypes, stateful=True, name=_node_name(name))
    for out, (_, shape) in zip(outputs, out_specs):
        out.set_shape(shape)
    return outputs


def _rows_unknown(shape):
    shape = tf.TensorShape(shape)
    if shape.rank is None or shape.rank == 0:
        return shape
    return tf.TensorShape([None]).concatenate(shape[1:])


def as_host_array(array):
    """Host callbacks get numpy arrays (tf.numpy_function passes 0-d tensors as numpy scalars); make sure they are
    C-contiguous arrays, as the core requires. Not np.ascontiguousarray: it turns 0-d arrays into 1-d ones."""
    if isinstance(array, np.generic):
        return np.asarray(array)
    if isinstance(array, np.ndarray) and not array.flags.c_contiguous:
        return np.array(array, order="C")
    return array


def output_like(array):
    """A 64-byte-aligned numpy result buffer (TF can then take it without a copy); cupy: let the core allocate."""
    return arrays.aligned_empty(array.shape, array.dtype) if isinstance(array, np.ndarray) else None


def _zeros_for_none(grads, like):
    return [tf.zeros_like(x) if g is None else g for g, x in zip(grads, like)]


class _TFPrimitives(gradient_rules.Primitives):
    """The backward collectives on tf tensors (host calls named after the forward's names + ".grad")."""

    def allreduce(self, grads, op, prescale_factor, postscale_factor, process_set, name):
        return _allreduce_raw(grads, [n + ".grad" for n in name], op, prescale_factor, postscale_factor, process_set)

    def allgather(self, grads, process_set, name):
        return [_allgather_raw(g, n + ".grad", process_set) for g, n in zip(grads, name)]

    def alltoall(self, grad, splits, process_set, name):
        return _alltoall_raw(grad, splits, name + ".grad", process_set)[0]

    def rows_of_rank(self, grad, rows, process_set, name):
        every = _allgather_raw(rows, name + ".grad.rows", process_set)
        me = process_set.rank()
        offset = tf.reduce_sum(every[:me])
        return grad[offset:offset + every[me]]

    def zeros_like(self, grad):
        return tf.zeros_like(grad)

    def scale(self, grad, factor):
        return grad * tf.cast(factor, grad.dtype)


_PRIMITIVES = _TFPrimitives()


def _backward(kind, grads, outputs, names, **forward):
    """Horovod's gradient of `kind` (ringtrain.reducer.gradient_rules) for upstream `grads` (None: zeros like outputs)."""
    return gradient_rules.backward(kind, _zeros_for_none(grads, outputs), _PRIMITIVES, name=names, **forward)


# ---------------------------------------------------------------- allreduce


def _allreduce_raw(tensors, names, op, prescale_factor, postscale_factor, process_set):
    """One host call reducing every tensor of the list (each its own named request; the engine fuses them)."""
    def run(*inputs):
        handles = [collectives.allreduce_async(as_host_array(x), op=op, name=n, prescale_factor=prescale_factor,
                                         postscale_factor=postscale_factor, out=output_like(x),
                                         process_set=process_set)
                   for x, n in zip(inputs, names)]
        return [h.wait() for h in handles]
    return host_call(run, tensors, [(t.dtype, t.shape) for t in tensors], names[0])


def _allreduce_differentiable(tensors, names, op, prescale_factor, postscale_factor, process_set):
    @tf.custom_gradient
    def reduce(*xs):
        ys = _allreduce_raw(list(xs), names, op, prescale_factor, postscale_factor, process_set)

        def grad(*dys):
            return _backward("allreduce", dys, ys, names, op=op, prescale_factor=prescale_factor,
                             postscale_factor=postscale_factor, process_set=process_set)
        return ys, grad
    return list(reduce(*tensors))


def _allreduce_indexed_slices(slices, name, op, process_set):
    """A sparse gradient: gather every rank's (values, indices) instead of densifying; Average divides by the size.
    dense_shape may be None (tf.IndexedSlices(values, indices)), as in Horovod: it is kept as it is."""
    if op not in (Average, Sum):      # Horovod's NotImplementedError
        raise UnsupportedOperationError(f"allreduce of tf.IndexedSlices supports op=Average or Sum, got {op!r}; "
                                        "densify it with tf.convert_to_tensor for other ops")
    values = allgather(slices.values, name=name + ".values", process_set=process_set)
    indices = allgather(slices.indices, name=name + ".indices", process_set=process_set)
    if op == Average:
        values = values / tf.cast(process_set.size(), values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def allreduce(tensor, average=None, device_dense="", device_sparse="", compression=Compression.none, op=None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0, name: "str | None" = None,
              process_set=global_process_set):
    """Reduce `tensor` over all ranks (default: Average). tf.IndexedSlices are gathered (values and indices).
    device_dense / device_sparse are accepted for Horovod compatibility and ignored (results stay where TF puts
    them). `compression` casts the tensor for the wire and back."""
    # an eager CPU tensor with no gradient tape recording and no compression: the core's call on a view of it (no
    # do_not_convert wrapper, custom_gradient or host call per call)
    if (type(tensor) is _EAGER_TENSOR and compression is _NO_COMPRESSION and not _could_record()
            and _context().executing_eagerly() and not arrays.is_gpu(tensor)):
        return _reduce_view(arrays.host_view(tensor), Average if op is None and average is None else
                            resolve_op(op, average, adasum=True), prescale_factor, postscale_factor, name, process_set)
    if type(tensor) is not _EAGER_TENSOR and not isinstance(tensor, (tf.Tensor, tf.IndexedSlices)):
        tensor = tf.convert_to_tensor(tensor)      # lists, arrays, variables
    # any other eager tensor with no gradient tape recording: straight to the core too
    if type(tensor) is _EAGER_TENSOR and tf.executing_eagerly() and not record.could_possibly_record():
        return _allreduce_eager(tensor, compression, resolve_op(op, average, adasum=True), prescale_factor,
                                postscale_factor, name, process_set)
    return _allreduce(tensor, average, compression, op, prescale_factor, postscale_factor, name, process_set)


_EAGER_TENSOR, _NO_COMPRESSION, _could_record = EagerTensor, Compression.none, record.could_possibly_record
_context = context.context         # tf.executing_eagerly() is this and a None check (~0.3 us more)
# a tf.function's autograph calls allreduce unconverted, as it does a do_not_convert function
autograph_api.autograph_artifact(allreduce)


@_no_autograph
def _allreduce(tensor, average, compression, op, prescale_factor, postscale_factor, name, process_set):
    """allreduce in a graph, under a tape, and of tf.IndexedSlices."""
    op = resolve_op(op, average, adasum=True)
    if isinstance(tensor, tf.IndexedSlices):
        return _allreduce_indexed_slices(tensor, _auto_name("allreduce", name, tensor.values, process_set), op,
                                         process_set)
    name = _auto_name("allreduce", name, tensor, process_set)
    wire, ctx = compression.compress(tensor)
    (reduced,) = _allreduce_differentiable([wire], [name], op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(reduced, ctx)


def _allreduce_eager(tensor, compression, op, prescale_factor, postscale_factor, name, process_set):
    """Eagerly with no gradient tape recording, compressed or a GPU tensor: as the fast path in allreduce."""
    wire, ctx = compression.compress(tensor)
    reduced = _reduce_view(arrays.to_array(wire), op, prescale_factor, postscale_factor, name, process_set)
    return compression.decompress(reduced, ctx)


def _reduce_view(array, op, prescale_factor, postscale_factor, name, process_set):
    """The eager call: the core's synchronous call (its express path) on a view of the tensor, with no
    custom_gradient and no host call around it (unnamed calls take the core's recurring unnamed names); the result
    in 64-byte-aligned memory TF adopts without a copy (small: a row of result_empty; large: the core's pool)."""
    out = arrays.result_empty(array.shape, array.dtype) if array.nbytes < EAGER_POOLED_BYTES else None
    try:
        result = collectives.allreduce(array, op, name, prescale_factor, postscale_factor, out, process_set)
    except TensorMismatchError as e:         # Horovod's type (tf.errors.FailedPreconditionError), ours too
        raise host_op.as_tf_error(e) from None
    return arrays.adopt(result) if result is out else arrays.to_tensor(result)


@_no_autograph
def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="", compression=Compression.none,
                      op=None, prescale_factor: float = 1.0, postscale_factor: float = 1.0, name: "str | None" = None,
                      process_set=global_process_set) -> list:
    """Allreduce a list of tensors as one group (one host call; the engine fuses them). tf.IndexedSlices in the
    list are gathered (values and indices), as allreduce does, dense_shape or not."""
    op = resolve_op(op, average, adasum=True)
    tensors = [t if isinstance(t, tf.IndexedSlices) else tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        raise ValueError("grouped_allreduce needs at least one tensor")
    first = tensors[0].values if isinstance(tensors[0], tf.IndexedSlices) else tensors[0]
    base = _auto_name("grouped_allreduce", name, first, process_set)
    out = [_allreduce_indexed_slices(t, f"{base}.{i}", op, process_set) if isinstance(t, tf.IndexedSlices) else None
           for i, t in enumerate(tensors)]
    dense = [i for i, t in enumerate(tensors) if out[i] is None]
    if dense:
        compressed = [compression.compress(tensors[i]) for i in dense]
        reduced = _allreduce_differentiable([w for w, _ in compressed], [f"{base}.{i}" for i in dense],
                                            op, prescale_factor, postscale_factor, process_set)
        for i, r, (_, ctx) in zip(dense, reduced, compressed):
            out[i] = compression.decompress(r, ctx)
    return out


# ---------------------------------------------------------------- allgather, broadcast, alltoall, reducescatter


def _allgather_raw(tensor, name, process_set):
    def run(x):
        return [collectives.allgather(as_host_array(x), name=name, process_set=process_set)]
    return host_call(run, [tensor], [(tensor.dtype, _rows_unknown(tensor.shape))], name)[0]


@_no_autograph
def allgather(tensor, name: "str | None" = None, process_set=global_process_set) -> tf.Tensor:
    """Concatenate every rank's tensor along dim 0 (dim 0 may differ per rank)."""
    tensor = tf.convert_to_tensor(tensor)
    if tensor.shape.rank == 0:
        raise ValueError("allgather needs a tensor with at least one dimension")
    name = _auto_name("allgather", name, tensor, process_set)

    @tf.custom_gradient
    def gather(x):
        y = _allgather_raw(x, name, process_set)

        def grad(dy):
            return _backward("allgather", [dy], [y], [name], rows=[tf.shape(x, out_type=tf.int64)[:1]],
                             process_set=process_set)[0]
        return y, grad
    return gather(tensor)


@_no_autograph
def grouped_allgather(tensors, name: "str | None" = None, process_set=global_process_set) -> list:
    """allgather of each tensor of a list (Horovod's grouped_allgather); differentiable. Returns a list."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        raise ValueError("grouped_allgather needs at least one tensor")
    base = _auto_name("grouped_allgather", name, tensors[0], process_set)
    return [allgather(t, name=f"{base}.{i}", process_set=process_set) for i, t in enumerate(tensors)]


def _broadcast_raw(tensors, names, root_rank, process_set):
    def run(*inputs):
        handles = [collectives.broadcast_async(as_host_array(x), root_rank, name=n, out=output_like(x),
                                         process_set=process_set)
                   for x, n in zip(inputs, names)]
        return [h.wait() for h in handles]
    return host_call(run, tensors, [(t.dtype, t.shape) for t in tensors], names[0])


@_no_autograph
def broadcast(tensor, root_rank: int = 0, name: "str | None" = None, process_set=global_process_set) -> tf.Tensor:
    """root_rank's tensor on every rank (root_rank is a world rank, also with a process set)."""
    tensor = tf.convert_to_tensor(tensor)
    name = _auto_name("broadcast", name, tensor, process_set)

    @tf.custom_gradient
    def bcast(x):
        y = _broadcast_raw([x], [name], root_rank, process_set)[0]

        def grad(dy):
            return _backward("broadcast", [dy], [y], [name], root_rank=root_rank, process_set=process_set)[0]
        return y, grad
    return bcast(tensor)


@_no_autograph
def broadcast_(variable: tf.Variable, root_rank: int = 0, name: "str | None" = None,
               process_set=global_process_set) -> tf.Variable:
    """Assign root_rank's value to `variable` on every rank; returns the variable."""
    variable.assign(broadcast(tf.convert_to_tensor(variable), root_rank,
                              name or f"broadcast_.{variable_name(variable)}", process_set))
    return variable


def variable_name(variable):
    """The variable's path ('sequential/dense/kernel') without Keras's per-process uniquifying suffixes
    ('sequential_3/dense_7/kernel'): those count the layers a process created so far, which may differ by rank."""
    name = getattr(variable, "path", None) or variable.name
    return "/".join(re.sub(r"_\d+$", "", part) for part in name.split(":")[0].split("/"))


@_no_autograph
def broadcast_variables(variables, root_rank: int = 0, prefix: str = "broadcast_variables",
                        process_set=global_process_set):
    """Assign root_rank's values to every variable (one host call for all of them; the engine fuses them).
    Every rank must pass the same variables in the same order. In a graph, returns the group of assignments."""
    variables = list(variables)
    if not variables:
        return tf.no_op() if not tf.executing_eagerly() else None
    names = [f"{prefix}.{i}.{variable_name(v)}" for i, v in enumerate(variables)]
    values = _broadcast_raw([tf.convert_to_tensor(v) for v in variables], names, root_rank, process_set)
    assignments = [v.assign(value) for v, value in zip(variables, values)]
    return None if tf.executing_eagerly() else tf.group(*assignments)


def broadcast_global_variables(root_rank: int):
    """Horovod's TF1 helper: broadcast every tf.compat.v1 global variable from root_rank, in a graph. Eagerly (TF2)
    there are no global variables: it raises, naming broadcast_variables, as Horovod's does."""
    if tf.executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution; use "
                           "hvd.broadcast_variables(<model/optimizer variables>, root_rank) instead")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


def _alltoall_raw(tensor, splits, name, process_set):
    def run(x, *maybe_splits):
        received, received_splits = collectives.alltoall(as_host_array(x), splits=maybe_splits[0] if maybe_splits else None,
                                                   name=name, process_set=process_set)
        return [received, np.asarray(received_splits, np.int32)]
    inputs = [tensor] if splits is None else [tensor, tf.cast(splits, tf.int32)]
    return host_call(run, inputs, [(tensor.dtype, _rows_unknown(tensor.shape)), (tf.int32, [process_set.size()])],
                     name)


@_no_autograph
def alltoall(tensor, splits=None, name: "str | None" = None, process_set=global_process_set):
    """Send splits[i] rows of `tensor` (dim 0) to rank i; returns (received tensor, received_splits int32)."""
    tensor = tf.convert_to_tensor(tensor)
    if tensor.shape.rank == 0:
        raise ValueError("alltoall needs a tensor with at least one dimension")
    name = _auto_name("alltoall", name, tensor, process_set)

    @tf.custom_gradient
    def exchange(x):
        received, received_splits = _alltoall_raw(x, splits, name, process_set)

        def grad(d_received, _d_splits):
            return _backward("alltoall", [d_received], [received], [name], splits=received_splits,
                             process_set=process_set)[0]
        return (received, received_splits), grad
    return exchange(tensor)


def _reducescatter_rows(rows, rank_, size_):
    """This rank's block of `rows` (the core's rule: split as evenly as possible, first blocks larger)."""
    return rows // size_ + (1 if rank_ < rows % size_ else 0)


def _reducescatter_raw(tensor, op, name, process_set, prescale_factor=1.0, postscale_factor=1.0):
    def run(x):
        return [collectives.reducescatter(as_host_array(x), op=op, name=name, process_set=process_set,
                                          prescale_factor=prescale_factor, postscale_factor=postscale_factor)]
    shape = tensor.shape
    if shape.rank and shape[0] is not None:
        rows = _reducescatter_rows(shape[0], process_set.rank(), process_set.size())
        shape = tf.TensorShape([rows]).concatenate(shape[1:])
    else:
        shape = _rows_unknown(shape)
    return host_call(run, [tensor], [(tensor.dtype, shape)], name)[0]


@_no_autograph
def reducescatter(tensor, op=Average, name: "str | None" = None, process_set=global_process_set,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> tf.Tensor:
    """Reduce over ranks and keep this rank's block of dim 0 (first blocks larger when it does not divide). The
    input is multiplied by prescale_factor before the sum (integers in float64, truncated back, as Horovod) and the
    result by postscale_factor."""
    op = as_op(op)
    tensor = tf.convert_to_tensor(tensor)
    if tensor.shape.rank == 0:
        raise ValueError("reducescatter needs a tensor with at least one dimension")
    name = _auto_name("reducescatter", name, tensor, process_set)

    @tf.custom_gradient
    def scatter(x):
        y = _reducescatter_raw(x, op, name, process_set, prescale_factor, postscale_factor)

        def grad(dy):
            return _backward("reducescatter", [dy], [y], [name], op=op, prescale_factor=prescale_factor,
                             postscale_factor=postscale_factor, process_set=process_set)[0]
        return y, grad
    return scatter(tensor)


@_no_autograph
def grouped_reducescatter(tensors, op=Average, name: "str | None" = None, process_set=global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> list:
    """reducescatter of each tensor of a list (Horovod's grouped_reducescatter); differentiable. Returns a list."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        raise ValueError("grouped_reducescatter needs at least one tensor")
    base = _auto_name("grouped_reducescatter", name, tensors[0], process_set)
    return [reducescatter(t, op, f"{base}.{i}", process_set, prescale_factor, postscale_factor)
            for i, t in enumerate(tensors)]


def broadcast_object_fn(root_rank: int = 0, session=None, name: "str | None" = None,
                        process_set=global_process_set):
    """Horovod's factory: a function obj -> root_rank's obj (pickle: trusted peers only). `session` (TF1) is
    accepted and not needed."""
    def broadcast_fn(obj):
        return broadcast_object(obj, root_rank, name=name, process_set=process_set)
    return broadcast_fn


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """Horovod's TF1 hook: after a tf.compat.v1 MonitoredSession is created, broadcast every global variable from
    root_rank (so all ranks start equal). `device` is accepted and ignored."""

    def __init__(self, root_rank: int = 0, device: str = "", process_set=global_process_set):
        super().__init__()
        self.root_rank = root_rank
        self.process_set = process_set
        self.bcast_op = None

    def begin(self):
        if self.bcast_op is None or self.bcast_op.graph != tf.compat.v1.get_default_graph():
            self.bcast_op = broadcast_variables(tf.compat.v1.global_variables(), self.root_rank,
                                                prefix="BroadcastGlobalVariablesHook", process_set=self.process_set)

    def after_create_session(self, session, coord):
        session.run(self.bcast_op)
