"""The differentiable collectives: allreduce, allgather, broadcast, alltoall, reducescatter and their grouped forms,
each a torch.autograd.Function with Horovod's gradient, so a loss can backpropagate through communication
(contrastive losses over the global batch, model parallelism).

    z = hvd.allgather(embeddings)            # every rank's rows; z.requires_grad if embeddings did
    loss(z).backward()                       # embeddings.grad = this rank's rows of the *averaged* gradient

Gradients (Horovod 0.28's rules):
- allreduce: an allreduce of the gradient with the same op and the same pre/post scale factors;
- allgather: this rank's slice of the gradient averaged over the set's ranks;
- broadcast: the gradient averaged over the set's ranks on the root, zero elsewhere;
- alltoall: the reverse alltoall (each block goes back where it came from);
- reducescatter: an allgather of the gradient, times the forward's scaling (1/size for Average, pre * post).
Backward passes run collectives too: every rank of the set must call backward through the same graph.
The *_async and in-place forms (functions.py) are not differentiable, as in Horovod.
"""
import torch

from ringtrain.process_sets import global_process_set

from . import functions
from .compression import Compression
from .functions import Average, Sum, as_op


def _set_size(process_set):
    return functions._set_size(process_set)


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, average, name, op, prescale_factor, postscale_factor, process_set):
        ctx.args = (average, op, prescale_factor, postscale_factor, process_set)
        return functions.allreduce_async(tensor, average, name, op, prescale_factor, postscale_factor,
                                         process_set).wait()

    @staticmethod
    def backward(ctx, grad_output):
        average, op, prescale_factor, postscale_factor, process_set = ctx.args
        grad = allreduce(grad_output, average=average, op=op, prescale_factor=prescale_factor,
                         postscale_factor=postscale_factor, process_set=process_set)
        return grad, None, None, None, None, None, None


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set):
    """Reduce `tensor` over the ranks of `process_set` (default: Average) into a new tensor; differentiable.
    `compression` casts it for the wire (e.g. Compression.fp16) and back."""
    compressed, ctx = compression.compress(tensor)
    result = _Allreduce.apply(compressed, average, name, op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(result, ctx)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, average, name, op, prescale_factor, postscale_factor, process_set, *tensors):
        ctx.args = (average, op, prescale_factor, postscale_factor, process_set)
        return tuple(functions.grouped_allreduce_async(list(tensors), average, name, op, prescale_factor,
                                                       postscale_factor, process_set).wait())

    @staticmethod
    def backward(ctx, *grad_outputs):
        average, op, prescale_factor, postscale_factor, process_set = ctx.args
        grads = grouped_allreduce(list(grad_outputs), average=average, op=op, prescale_factor=prescale_factor,
                                  postscale_factor=postscale_factor, process_set=process_set)
        return (None,) * 6 + tuple(grads)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set):
    """allreduce of each tensor, negotiated and fused as one group; differentiable. Returns a list."""
    compressed = [compression.compress(t) for t in tensors]
    results = _GroupedAllreduce.apply(average, name, op, prescale_factor, postscale_factor, process_set,
                                      *[c for c, _ in compressed])
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(results, compressed)]


def _my_rows(grad, process_set, my_rows):
    """Rows of `grad` (dim 0) that came from this rank in an allgather: offsets from an allgather of the row counts
    (each rank's dim 0 may differ)."""
    counts = functions.allgather_async(torch.tensor([my_rows], dtype=torch.int64), process_set=process_set).wait()
    me = process_set.rank() if process_set is not None else functions.rank()
    offset = int(counts[:me].sum())
    return grad.narrow(0, offset, my_rows)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.rows, ctx.process_set = tensor.shape[0], process_set
        return functions.allgather_async(tensor, name, process_set).wait()

    @staticmethod
    def backward(ctx, grad_output):
        averaged = allreduce(grad_output, op=Average, process_set=ctx.process_set)
        return _my_rows(averaged, ctx.process_set, ctx.rows), None, None


def allgather(tensor, name=None, process_set=global_process_set):
    """Concatenate every rank's tensor along dim 0 (dim 0 may differ per rank); differentiable."""
    return _Allgather.apply(tensor, name, process_set)


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.rows, ctx.process_set = [t.shape[0] for t in tensors], process_set
        return tuple(functions.grouped_allgather_async(list(tensors), name, process_set).wait())

    @staticmethod
    def backward(ctx, *grad_outputs):
        averaged = grouped_allreduce(list(grad_outputs), op=Average, process_set=ctx.process_set)
        return (None, None) + tuple(_my_rows(g, ctx.process_set, rows) for g, rows in zip(averaged, ctx.rows))


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """allgather of each tensor under one handle; differentiable. Returns a list."""
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return functions.broadcast_async(tensor, root_rank, name, process_set).wait()

    @staticmethod
    def backward(ctx, grad_output):
        grad = allreduce(grad_output, op=Average, process_set=ctx.process_set)
        if functions.rank() != ctx.root_rank:      # root_rank is a world rank, as in the forward
            grad = torch.zeros_like(grad)
        return grad, None, None, None


def broadcast(tensor, root_rank=0, name=None, process_set=global_process_set):
    """root_rank's `tensor` on every rank of the set, as a new tensor; differentiable. root_rank is a world rank."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        output, received_splits = functions.alltoall_async(tensor, splits, name, process_set).wait()
        ctx.received_splits, ctx.process_set = received_splits, process_set
        if splits is None:
            return output
        ctx.mark_non_differentiable(received_splits)
        return output, received_splits

    @staticmethod
    def backward(ctx, grad_output, *_received_splits_grad):
        grad, _ = functions.alltoall_async(grad_output.contiguous(), ctx.received_splits,
                                           process_set=ctx.process_set).wait()
        return grad, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Send splits[i] rows of `tensor` to rank i of the set (even split when None); differentiable.
    Returns the received tensor alone when splits is None, else (received tensor, received splits), as Horovod."""
    return _Alltoall.apply(tensor, splits, name, process_set)


def _reducescatter_grad_scale(op, process_set, prescale_factor, postscale_factor):
    op = as_op(op)
    if op not in (Average, Sum):
        raise ValueError(f"reducescatter's gradient is defined for op=Average or Sum, not {op.name.title()}")
    return prescale_factor * postscale_factor / (_set_size(process_set) if op == Average else 1)


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale_factor, postscale_factor):
        ctx.args = (op, process_set, prescale_factor, postscale_factor)
        return functions.reducescatter_async(tensor, name, op, process_set, prescale_factor, postscale_factor).wait()

    @staticmethod
    def backward(ctx, grad_output):
        op, process_set, prescale_factor, postscale_factor = ctx.args
        grad = allgather(grad_output.contiguous(), process_set=process_set)
        return grad * _reducescatter_grad_scale(op, process_set, prescale_factor, postscale_factor), \
            None, None, None, None, None


def reducescatter(tensor, name=None, compression=Compression.none, op=Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0):
    """Reduce over the set's ranks and keep this rank's block of dim 0 (first blocks larger when it does not
    divide); differentiable."""
    compressed, ctx = compression.compress(tensor)
    result = _Reducescatter.apply(compressed, name, op, process_set, prescale_factor, postscale_factor)
    return compression.decompress(result, ctx)


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, process_set, prescale_factor, postscale_factor, *tensors):
        ctx.args = (op, process_set, prescale_factor, postscale_factor)
        return tuple(functions.grouped_reducescatter_async(list(tensors), name, op, process_set, prescale_factor,
                                                           postscale_factor).wait())

    @staticmethod
    def backward(ctx, *grad_outputs):
        op, process_set, prescale_factor, postscale_factor = ctx.args
        scale = _reducescatter_grad_scale(op, process_set, prescale_factor, postscale_factor)
        grads = grouped_allgather([g.contiguous() for g in grad_outputs], process_set=process_set)
        return (None,) * 5 + tuple(g * scale for g in grads)


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """reducescatter of each tensor under one handle; differentiable. Returns a list."""
    compressed = [compression.compress(t) for t in tensors]
    results = _GroupedReducescatter.apply(name, op, process_set, prescale_factor, postscale_factor,
                                          *[c for c, _ in compressed])
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(results, compressed)]


__all__ = ["allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "alltoall",
           "reducescatter", "grouped_reducescatter"]
