"""The core API on torch tensors, with Horovod's names.

CPU tensors are handed to the core as numpy views of the same memory (no copy): `t.detach().numpy()`, and bfloat16,
which numpy lacks, as an int16 view reinterpreted as ml_dtypes.bfloat16. CUDA tensors go through DLPack into the GPU
path (ringtrain.gpu), imported only when a CUDA tensor is seen, so the CPU path never imports cupy.

Trailing underscore = in place (`allreduce_(t)` writes the result into `t`), as in Horovod and torch.
Every *_async call returns a TensorHandle; `synchronize(handle)` (or `handle.wait()`) returns torch tensors.

    import ringtrain.torch as hvd
    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum)   # tensor([0+1+...+size-1])
"""

import ml_dtypes
import numpy as np
import torch

from ringtrain.core import collectives, grouped, state
from ringtrain.core.build_info import (ccl_built, cuda_built, ddl_built, gloo_built, gloo_enabled,  # noqa: F401
                                  mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rocm_built)
from ringtrain.ops import Adasum, Average, Sum, Min, Max, Product, ReduceOp, as_op  # noqa: F401  (re-exported)
from ringtrain.ops import resolve_op
from ringtrain.core.process_sets import (ProcessSet, add_process_set, global_process_set,  # noqa: F401
                                    remove_process_set)

from . import group_reads, host_views
from .compression import Compression

_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


# ---------------------------------------------------------------- lifecycle and topology (thin pass-through)

def init(comm=None, process_sets: "list | None" = None, **config_overrides) -> None:
    """Start ringtrain (MPI, topology, engine) and register `process_sets`. Keyword overrides are
    ringtrain.config.Config fields."""
    return state.init(comm, process_sets=process_sets, **config_overrides)


def is_homogeneous() -> bool:
    """True when every node runs the same number of ranks."""
    return state.is_homogeneous()


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Write the Chrome-trace timeline to file_path from now on (see ringtrain.timeline)."""
    return state.start_timeline(file_path, mark_cycles)


def stop_timeline() -> None:
    """Stop writing the timeline and close its file."""
    return state.stop_timeline()


def shutdown() -> None:
    """Stop ringtrain on this rank: finish pending collectives, stop the engine, free its resources."""
    return state.shutdown()


def is_initialized() -> bool:
    """True between init() and shutdown()."""
    return state.is_initialized()


def rank() -> int:
    """This process's rank in the world, 0 .. size() - 1."""
    return state.rank()


def size() -> int:
    """The number of ranks in the world."""
    return state.size()


def local_rank() -> int:
    """This process's rank among the ranks of its node."""
    return state.local_rank()


def local_size() -> int:
    """The number of ranks on this process's node."""
    return state.local_size()


def cross_rank() -> int:
    """The index of this process's node among the nodes."""
    return state.cross_rank()


def cross_size() -> int:
    """The number of nodes."""
    return state.cross_size()


def device() -> torch.device:
    """torch.device of the GPU bound to this rank at init, or cpu on machines without one."""
    gpu = state.gpu_device()
    return torch.device("cpu") if gpu is None else torch.device("cuda", gpu)


# ---------------------------------------------------------------- tensor <-> array

def to_array(tensor):
    """A numpy (CPU) or cupy (CUDA) array sharing memory with `tensor`. The tensor must be contiguous:
    callers that need in-place semantics make it so first (see _contiguous)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    t = tensor.detach() if tensor.requires_grad else tensor    # detach() costs a few us per call: gradients skip it
    if t.is_cuda:
        from ringtrain.gpu import from_dlpack  # GPU path only: keeps cupy out of CPU-only processes
        return from_dlpack(t)
    if not t.is_cpu:                # (t.device builds an object: 1.5 us, a tenth of a small allreduce)
        raise TypeError(f"tensors on device {t.device} are not supported; use cpu or cuda")
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(_BFLOAT16)
    return t.numpy()


def from_array(array):
    """A torch tensor sharing memory with a numpy or cupy array (the inverse of to_array)."""
    if isinstance(array, np.ndarray) or np.isscalar(array):
        array = np.asarray(array)
        if array.dtype == _BFLOAT16:
            return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        if not array.flags.writeable:   # torch warns on read-only buffers; results are ours to own
            array = array.copy()
        return torch.from_numpy(array)
    return torch.from_dlpack(array)      # cupy (CUDA) results


def contiguous(tensor):
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def host_array(tensor):
    """to_array(contiguous(tensor)) for the allreduce forms: a contiguous CPU tensor's numpy view is kept and
    reused while it stays true (host_views.py: t.numpy() and its checks cost a tenth of a small allreduce)."""
    array = host_views.view(tensor)
    if array is None:
        work = contiguous(tensor)
        array = to_array(work)
        if work is tensor and array.__class__ is np.ndarray:
            host_views.keep(tensor, array)
    return array


class TensorHandle:
    """Wraps the core Handle: wait() converts the arrays it returns back into torch tensors (finish), or returns
    `result` when there is nothing to convert (finish None: an in-place call on a contiguous tensor)."""
    __slots__ = ("handle", "_finish", "_done", "_result")

    def __init__(self, handle, finish, result=None):
        self.handle = handle
        self._finish = finish
        self._done = False
        self._result = result

    @property
    def times(self):
        return self.handle.times

    def poll(self):
        return self.handle.poll()

    def wait(self, timeout=None):
        if not self._done:
            finish = self._finish
            if finish is None:
                self.handle.wait(timeout)
            else:
                self._result = finish(self.handle.wait(timeout))
            self._done = True
        return self._result

    def __repr__(self):
        return f"<TensorHandle {self.handle!r}>"


def synchronize(handle: "TensorHandle | SparseHandle"):
    """Block until an async collective finishes; return its result as torch tensor(s)."""
    if handle.__class__ is TensorHandle:
        return handle.wait()
    if not hasattr(handle, "wait") and callable(handle):
        return handle()
    return handle.wait()


def poll(handle: "TensorHandle | SparseHandle") -> bool:
    """True once an async collective has finished; never blocks."""
    return handle.poll()


# ---------------------------------------------------------------- allreduce (in place and async; the differentiable
# copies allreduce/grouped_allreduce/... live in autograd.py)

def allreduce_async(tensor: torch.Tensor, average=None, name: "str | None" = None, op=None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> "TensorHandle":
    """Start an allreduce of `tensor` into a new tensor; returns a TensorHandle."""
    op = resolve_op(op, average, adasum=True)
    array = host_array(tensor)
    handle = collectives.allreduce_async(array, op=op, name=name, prescale_factor=prescale_factor,
                                   postscale_factor=postscale_factor, process_set=process_set)
    # a host result of a dtype numpy has is a fresh writable array: torch.from_numpy is all from_array would do
    return TensorHandle(handle, torch.from_numpy if array.__class__ is np.ndarray and
                        tensor.dtype is not torch.bfloat16 else from_array)


def allreduce_sync(tensor: torch.Tensor, average=None, name: "str | None" = None, op=None,
                   prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                   process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """allreduce into a new tensor on this thread (the core's synchronous call: the engine's express path when it
    applies); not differentiable -- autograd.allreduce uses it when no gradient is wanted."""
    array = collectives.allreduce(host_array(tensor), op=resolve_op(op, average, adasum=True), name=name,
                                  prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                                  process_set=process_set)
    # a host result of a dtype numpy has is a fresh writable array: torch.from_numpy is all from_array would do
    if array.__class__ is np.ndarray and tensor.dtype is not torch.bfloat16:
        return torch.from_numpy(array)
    return from_array(array)


def grouped_allreduce_sync(tensors: list, average=None, name: "str | None" = None, op=None,
                           prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                           process_set: ProcessSet = global_process_set) -> list:
    """grouped_allreduce into new tensors on this thread (the core's synchronous call); not differentiable."""
    op = Average if op is None and average is None else resolve_op(op, average, adasum=True)
    key = None
    if op.__class__ is ReduceOp:        # (Adasum is not one)
        # a recurring group of plain CPU tensors: keyed by torch's own attributes (dtype, shape, is_cpu; contiguous
        # groups only) and read where it lies (the core's plan; made on the first call, from the numpy views)
        try:
            signature, members = group_reads.read(tensors)
        except (AttributeError, RuntimeError, TypeError):    # not tensors, or sparse: the general path says why
            members = None
        if members is not None:
            results, name, key = grouped.planned_call(members, signature, op, name, prescale_factor,
                                                      postscale_factor, process_set)
            if results is not None:
                return list(map(torch.from_numpy, results))
    arrays = _plain_arrays(tensors)
    plain = arrays is not None
    if not plain:                       # (the plan is for plain tensors: contiguous, on the CPU, numpy's dtypes)
        arrays = [to_array(contiguous(t)) for t in tensors]
        key = None
    if key is not None:
        results = grouped.allreduce(arrays, op, name, prescale_factor, postscale_factor, None, process_set, key)
    else:
        results = collectives.grouped_allreduce(arrays, op=op, name=name, process_set=process_set,
                                                prescale_factor=prescale_factor, postscale_factor=postscale_factor)
    # plain: results of numpy dtypes on the host, fresh writable arrays: torch.from_numpy is all from_array would do
    return [torch.from_numpy(r) for r in results] if plain else [from_array(r) for r in results]


def _plain_arrays(tensors):
    """numpy views of contiguous CPU tensors of numpy dtypes that need no gradient, by t.numpy() alone (to_array's
    checks, a call each, cost as much per tensor as a small group's collective); None when any tensor is something
    else (CUDA, bfloat16, requiring grad, not contiguous, not a tensor): to_array's path then."""
    try:
        arrays = [t.numpy() for t in tensors]       # raises for CUDA, bfloat16 and tensors that require grad
    except (TypeError, RuntimeError, AttributeError):
        return None
    for a in arrays:
        if not a.flags.c_contiguous:
            return None
    return arrays


def allreduce_async_(tensor: torch.Tensor, average=None, name: "str | None" = None, op=None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> "TensorHandle":
    """Start an in-place allreduce: the result is written into `tensor`; the handle's wait() returns `tensor`."""
    op, work, array = _in_place(tensor, average, op)
    handle = collectives.allreduce_async(array, op=op, name=name, prescale_factor=prescale_factor,
                                   postscale_factor=postscale_factor, out=array, process_set=process_set)
    if work is tensor:          # the result is in `tensor` already
        return TensorHandle(handle, None, tensor)
    return TensorHandle(handle, lambda _result: copy_back(tensor, work))


def allreduce_(tensor: torch.Tensor, average=None, name: "str | None" = None, op=None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0, process_set=global_process_set) -> torch.Tensor:
    """Allreduce `tensor` in place (default op: Average) and return it. Arguments as allreduce()."""
    # the core's synchronous call: this thread drives the engine itself, the engine thread is not woken
    op, work, array = _in_place(tensor, average, op)
    collectives.allreduce(array, op=op, name=name, prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                    out=array, process_set=process_set)
    return tensor if work is tensor else copy_back(tensor, work)


def _in_place(tensor, average, op):
    array = host_views.view(tensor)
    if array is not None:
        return resolve_op(op, average, adasum=True), tensor, array
    work = contiguous(tensor)
    array = to_array(work)
    if work is tensor and array.__class__ is np.ndarray:
        host_views.keep(tensor, array)
    return resolve_op(op, average, adasum=True), work, array


def copy_back(tensor, work):
    """In-place ops on a non-contiguous tensor ran on a contiguous copy; put the result where the user expects it."""
    if work is not tensor:
        with torch.no_grad():
            tensor.copy_(work)
    return tensor


def grouped_allreduce_async(tensors: list, average=None, name: "str | None" = None, op=None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> "TensorHandle":
    """One handle for many tensors, negotiated and fused together; wait() returns the list of results."""
    op = resolve_op(op, average, adasum=True)
    arrays = [to_array(contiguous(t)) for t in tensors]
    handle = collectives.grouped_allreduce_async(arrays, op=op, name=name, process_set=process_set,
                                           **_scales(prescale_factor, postscale_factor))
    return TensorHandle(handle, lambda results: [from_array(r) for r in results])


def grouped_allreduce_async_(tensors: list, average=None, name: "str | None" = None, op=None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> "TensorHandle":
    """In-place grouped allreduce: each result lands in its own tensor; wait() returns the list of tensors."""
    op = resolve_op(op, average, adasum=True)
    tensors = list(tensors)
    works = [contiguous(t) for t in tensors]
    arrays = [to_array(w) for w in works]
    handle = collectives.grouped_allreduce_async(arrays, op=op, name=name, outs=arrays, process_set=process_set,
                                           **_scales(prescale_factor, postscale_factor))
    return TensorHandle(handle, lambda _results: [copy_back(t, w) for t, w in zip(tensors, works)])


def grouped_allreduce_(tensors, average=None, name: "str | None" = None, op=None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0, process_set=global_process_set) -> list:
    """Allreduce several tensors in place as one collective and return the list of them."""
    return grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                    process_set).wait()


def _scales(prescale_factor, postscale_factor):
    """Pass scale factors only when they do something (keeps the common call minimal)."""
    scales = {}
    if prescale_factor != 1.0:
        scales["prescale_factor"] = prescale_factor
    if postscale_factor != 1.0:
        scales["postscale_factor"] = postscale_factor
    return scales


class SparseHandle:
    """What sparse_allreduce_async returns: wait() (or calling it, as Horovod's optimizer does) gives the sparse sum
    or average of every rank's sparse tensor."""
    __slots__ = ("_indices", "_values", "_finish")

    def __init__(self, indices, values, finish):
        self._indices, self._values, self._finish = indices, values, finish

    def poll(self):
        return self._indices.poll() and self._values.poll()

    def wait(self, timeout=None):
        return self._finish(self._indices.wait(timeout), self._values.wait(timeout))

    __call__ = wait


def sparse_allreduce_async(tensor: torch.Tensor, name: "str | None", op,
                           process_set: ProcessSet = global_process_set) -> "SparseHandle":
    """Allreduce of a sparse COO tensor as Horovod does it: allgather every rank's indices and values (duplicates
    summed when the result is coalesced); op=Average divides the values by the set's size."""
    op = resolve_op(op, None)
    if op not in (Average, Sum):
        raise ValueError(f"sparse_allreduce supports op=Average or Sum, got {op.name.title()}")
    t = tensor.coalesce() if not tensor.is_coalesced() else tensor
    # allgather concatenates dim 0: ship indices as (nnz, ndim) rows
    indices = allgather_async(t.indices().t().contiguous(), name=f"{name}.indices", process_set=process_set)
    values = allgather_async(t.values().contiguous(), name=f"{name}.values", process_set=process_set)
    divisor = set_size(process_set) if op == Average else 1

    def finish(all_indices, all_values):
        if divisor != 1:
            all_values = all_values / divisor
        return torch.sparse_coo_tensor(all_indices.t(), all_values, t.shape).coalesce()
    return SparseHandle(indices, values, finish)


def set_size(process_set):
    return size() if process_set is None or process_set.process_set_id == 0 else process_set.size()


# ---------------------------------------------------------------- allgather, broadcast, alltoall, reducescatter

def allgather_async(tensor: torch.Tensor, name: "str | None" = None,
                    process_set: ProcessSet = global_process_set, out: "torch.Tensor | None" = None) -> "TensorHandle":
    """Concatenate every rank's tensor along dim 0 (dim 0 may differ per rank). out: a contiguous tensor of the
    gathered shape to write into (wait() then returns it); a `tensor` that is a view of out at this rank's place
    is not copied at all."""
    if out is None:
        handle = collectives.allgather_async(to_array(contiguous(tensor)), name=name, process_set=process_set)
        return TensorHandle(handle, from_array)
    if not out.is_contiguous():
        raise ValueError(f"allgather out of shape {tuple(out.shape)} is not contiguous")
    handle = collectives.allgather_async(to_array(contiguous(tensor)), name=name, process_set=process_set,
                                   out=to_array(out))
    return TensorHandle(handle, lambda _result: out)


def grouped_allgather_async(tensors, name: "str | None" = None, process_set=global_process_set):
    """Start an allgather of each tensor under one handle; synchronize(handle) returns the list of results."""
    handle = collectives.grouped_allgather_async([to_array(contiguous(t)) for t in tensors], name=name,
                                           process_set=process_set)
    return TensorHandle(handle, lambda results: [from_array(r) for r in results])


def broadcast_async(tensor: torch.Tensor, root_rank: int = 0, name: "str | None" = None,
                    process_set: ProcessSet = global_process_set) -> "TensorHandle":
    """Start a broadcast of root_rank's `tensor` into a new tensor on every rank. root_rank is a world rank."""
    handle = collectives.broadcast_async(to_array(contiguous(tensor)), root_rank=root_rank, name=name,
                                   process_set=process_set)
    return TensorHandle(handle, from_array)


def broadcast_async_(tensor: torch.Tensor, root_rank: int = 0, name: "str | None" = None,
                     process_set: ProcessSet = global_process_set) -> "TensorHandle":
    """Start an in-place broadcast: every rank's `tensor` becomes root_rank's."""
    work = contiguous(tensor)
    array = to_array(work)
    handle = collectives.broadcast_async(array, root_rank=root_rank, name=name, out=array, process_set=process_set)
    return TensorHandle(handle, lambda _result: copy_back(tensor, work))


def broadcast_(tensor: torch.Tensor, root_rank: int = 0, name: "str | None" = None,
               process_set=global_process_set) -> torch.Tensor:
    """Overwrite `tensor` with `root_rank`'s tensor (a world rank) and return it."""
    return broadcast_async_(tensor, root_rank, name, process_set).wait()


def alltoall_async(tensor: torch.Tensor, splits=None, name: "str | None" = None,
                   process_set: ProcessSet = global_process_set) -> "TensorHandle":
    """Send splits[i] rows of `tensor` (dim 0) to rank i of the set; wait() returns (received tensor,
    received_splits tensor), as Horovod's synchronize() does for alltoall handles."""
    splits_dtype = torch.int32      # Horovod's: int32, or the dtype of the splits tensor passed in
    if isinstance(splits, torch.Tensor):
        splits_dtype, splits = splits.dtype, splits.tolist()
    handle = collectives.alltoall_async(to_array(contiguous(tensor)), splits=splits, name=name, process_set=process_set)

    def finish(result):
        received, received_splits = result
        return from_array(received), torch.tensor(list(received_splits), dtype=splits_dtype)
    return TensorHandle(handle, finish)


def reducescatter_async(tensor: torch.Tensor, name: "str | None" = None, op=Average,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> "TensorHandle":
    """Reduce over ranks and keep this rank's block of dim 0 (first blocks larger when it does not divide)."""
    handle = collectives.reducescatter_async(to_array(contiguous(tensor)), op=as_op(op), name=name,
                                       process_set=process_set, prescale_factor=prescale_factor,
                                       postscale_factor=postscale_factor)
    return TensorHandle(handle, from_array)


def grouped_reducescatter_async(tensors, name: "str | None" = None, op=Average, process_set=global_process_set,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0):
    """Start a reducescatter of each tensor under one handle; synchronize(handle) returns this rank's blocks."""
    handle = collectives.grouped_reducescatter_async([to_array(contiguous(t)) for t in tensors], op=as_op(op), name=name,
                                               process_set=process_set, prescale_factor=prescale_factor,
                                               postscale_factor=postscale_factor)
    return TensorHandle(handle, lambda results: [from_array(r) for r in results])


# ---------------------------------------------------------------- control and objects

def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Returns once every rank of `process_set` has called barrier()."""
    return collectives.barrier(process_set=process_set)


def join(device: int = -1) -> int:
    """This rank has no more data: it contributes zeros to the other ranks' allreduces until every rank has joined.
    Returns the last rank to join (the one whose parameters saw every step; broadcast from it afterwards).
    `device` is accepted for Horovod's signature: the zeros are made where each tensor lives."""
    return int(collectives.join())


def broadcast_object(obj, root_rank: int = 0, name: "str | None" = None, process_set: ProcessSet = global_process_set):
    """root_rank's picklable object on every rank. Uses pickle: only for trusted peers (your own job's ranks)."""
    return collectives.broadcast_object(obj, root_rank=root_rank, name=name, process_set=process_set)


def allgather_object(obj, name: "str | None" = None, process_set: ProcessSet = global_process_set) -> list:
    """List of every rank's picklable object, in rank order. Uses pickle: only for trusted peers."""
    return collectives.allgather_object(obj, name=name, process_set=process_set)
