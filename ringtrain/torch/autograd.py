"""The differentiable collectives: allreduce, allgather, broadcast, alltoall, reducescatter and their grouped forms,
each a torch.autograd.Function with Horovod's gradient, so a loss can backpropagate through communication
(contrastive losses over the global batch, model parallelism).

    z = hvd.allgather(embeddings)            # every rank's rows; z.requires_grad if embeddings did
    loss(z).backward()                       # embeddings.grad = this rank's rows of the *averaged* gradient

The gradients are ringtrain.reducer.gradient_rules' table (Horovod 0.28's rules, shared with ringtrain.tensorflow):
- allreduce: an allreduce of the gradient with the same op and the same pre/post scale factors;
- allgather: this rank's slice of the gradient averaged over the set's ranks;
- broadcast: the gradient averaged over the set's ranks on the root, zero elsewhere;
- alltoall: the reverse alltoall (each block goes back where it came from);
- reducescatter: an allgather of the gradient, times the set's size for op=Sum, times pre * post scale factors.
Backward passes run collectives too: every rank of the set must call backward through the same graph.
The *_async and in-place forms (functions.py) are not differentiable, as in Horovod.
"""
import operator

import torch

from ringtrain.reducer import gradient_rules
from ringtrain.ops import resolve_op
from ringtrain.core.process_sets import global_process_set

from . import functions
from .compression import Compression
from .functions import Average, as_op

_requires_grad = operator.attrgetter("requires_grad")


class _TorchPrimitives(gradient_rules.Primitives):
    """The backward collectives on torch tensors: the differentiable ones below, so double backward works."""

    def allreduce(self, grads, op, prescale_factor, postscale_factor, process_set, name):
        return grouped_allreduce(grads, op=op, prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                                 process_set=process_set)

    def allgather(self, grads, process_set, name):
        return grouped_allgather([g.contiguous() for g in grads], process_set=process_set)

    def alltoall(self, grad, splits, process_set, name):
        return functions.alltoall_async(grad.contiguous(), splits, process_set=process_set).wait()[0]

    def rows_of_rank(self, grad, rows, process_set, name):
        # offsets from an allgather of the row counts (each rank's dim 0 may differ)
        counts = functions.allgather_async(torch.tensor([rows], dtype=torch.int64), process_set=process_set).wait()
        me = process_set.rank() if process_set is not None else functions.rank()
        return grad.narrow(0, int(counts[:me].sum()), rows)

    def zeros_like(self, grad):
        return torch.zeros_like(grad)

    def scale(self, grad, factor):
        return grad * factor


_PRIMITIVES = _TorchPrimitives()


def _backward(kind, grads, **forward):
    return gradient_rules.backward(kind, grads, _PRIMITIVES, **forward)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, average, name, op, prescale_factor, postscale_factor, process_set, *tensors):
        ctx.forward = dict(op=resolve_op(op, average, adasum=True), prescale_factor=prescale_factor,
                           postscale_factor=postscale_factor, process_set=process_set)
        return tuple(_allreduce_forward(tensors, average, name, op, prescale_factor, postscale_factor, process_set))

    @staticmethod
    def backward(ctx, *grad_outputs):
        return (None,) * 6 + tuple(_backward("allreduce", grad_outputs, **ctx.forward))


def _allreduce_forward(tensors, average, name, op, prescale_factor, postscale_factor, process_set):
    """The collective itself, on this thread (the engine's express path when it applies)."""
    if len(tensors) == 1:
        return [functions.allreduce_sync(tensors[0], average, name, op, prescale_factor, postscale_factor,
                                         process_set)]
    return functions.grouped_allreduce_sync(list(tensors), average, name, op, prescale_factor, postscale_factor,
                                            process_set)


def _wants_grad(tensors):
    """Autograd records the call only when a gradient can flow: grad mode on and some input requires it. Otherwise
    the call skips torch.autograd.Function altogether (its bookkeeping costs more than a small allreduce)."""
    return torch.is_grad_enabled() and any([t.requires_grad for t in tensors])   # (a list: no generator frames)


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set) -> torch.Tensor:
    """Reduce `tensor` over the ranks of `process_set` (default: Average) into a new tensor; differentiable.
    `compression` casts it for the wire (e.g. Compression.fp16) and back."""
    # (_wants_grad of one tensor, inline: a metric averaged every step pays for every frame)
    if compression is Compression.none and not (tensor.requires_grad and torch.is_grad_enabled()):
        return functions.allreduce_sync(tensor, average, name, op, prescale_factor, postscale_factor, process_set)
    return grouped_allreduce([tensor], average, name, compression, op, prescale_factor, postscale_factor,
                             process_set)[0]


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set) -> list:
    """allreduce of each tensor, negotiated and fused as one group; differentiable. Returns a list."""
    tensors = list(tensors)
    # (_wants_grad inline: a grouped call's own cost is a few us)
    if compression is Compression.none and not (any(map(_requires_grad, tensors)) and torch.is_grad_enabled()):
        if len(tensors) > 1:
            return functions.grouped_allreduce_sync(tensors, average, name, op, prescale_factor, postscale_factor,
                                                    process_set)
        return _allreduce_forward(tensors, average, name, op, prescale_factor, postscale_factor, process_set)
    compressed = [compression.compress(t) for t in tensors]
    if not _wants_grad([c for c, _ in compressed]):
        results = _allreduce_forward([c for c, _ in compressed], average, name, op, prescale_factor,
                                     postscale_factor, process_set)
        return [compression.decompress(r, ctx) for r, (_, ctx) in zip(results, compressed)]
    results = _GroupedAllreduce.apply(average, name, op, prescale_factor, postscale_factor, process_set,
                                      *[c for c, _ in compressed])
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(results, compressed)]


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.forward = dict(rows=[t.shape[0] for t in tensors], process_set=process_set)
        if len(tensors) == 1:
            return functions.allgather_async(tensors[0], name, process_set).wait(),
        return tuple(functions.grouped_allgather_async(list(tensors), name, process_set).wait())

    @staticmethod
    def backward(ctx, *grad_outputs):
        return (None, None) + tuple(_backward("allgather", grad_outputs, **ctx.forward))


def allgather(tensor, name=None, process_set=global_process_set) -> torch.Tensor:
    """Concatenate every rank's tensor along dim 0 (dim 0 may differ per rank); differentiable."""
    return _GroupedAllgather.apply(name, process_set, tensor)[0]


def grouped_allgather(tensors, name=None, process_set=global_process_set) -> list:
    """allgather of each tensor under one handle; differentiable. Returns a list."""
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.forward = dict(root_rank=root_rank, process_set=process_set)
        return functions.broadcast_async(tensor, root_rank, name, process_set).wait()

    @staticmethod
    def backward(ctx, grad_output):
        (grad,) = _backward("broadcast", [grad_output], **ctx.forward)
        return grad, None, None, None


def broadcast(tensor, root_rank=0, name=None, process_set=global_process_set) -> torch.Tensor:
    """root_rank's `tensor` on every rank of the set, as a new tensor; differentiable. root_rank is a world rank."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        output, received_splits = functions.alltoall_async(tensor, splits, name, process_set).wait()
        ctx.forward = dict(splits=received_splits, process_set=process_set)
        if splits is None:
            return output
        ctx.mark_non_differentiable(received_splits)
        return output, received_splits

    @staticmethod
    def backward(ctx, grad_output, *_received_splits_grad):
        (grad,) = _backward("alltoall", [grad_output], **ctx.forward)
        return grad, None, None, None


def alltoall(tensor: torch.Tensor, splits=None, name: "str | None" = None, process_set=global_process_set):
    """Send splits[i] rows of `tensor` to rank i of the set (even split when None); differentiable.
    Returns the received tensor alone when splits is None, else (received tensor, received splits), as Horovod."""
    return _Alltoall.apply(tensor, splits, name, process_set)


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, process_set, prescale_factor, postscale_factor, *tensors):
        ctx.forward = dict(op=as_op(op), process_set=process_set, prescale_factor=prescale_factor,
                           postscale_factor=postscale_factor)
        if len(tensors) == 1:
            return functions.reducescatter_async(tensors[0], name, op, process_set, prescale_factor,
                                                 postscale_factor).wait(),
        return tuple(functions.grouped_reducescatter_async(list(tensors), name, op, process_set, prescale_factor,
                                                           postscale_factor).wait())

    @staticmethod
    def backward(ctx, *grad_outputs):
        return (None,) * 5 + tuple(_backward("reducescatter", grad_outputs, **ctx.forward))


def reducescatter(tensor, name=None, compression=Compression.none, op=Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0) -> torch.Tensor:
    """Reduce over the set's ranks and keep this rank's block of dim 0 (first blocks larger when it does not
    divide); differentiable."""
    return grouped_reducescatter([tensor], name, compression, op, process_set, prescale_factor, postscale_factor)[0]


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0) -> list:
    """reducescatter of each tensor under one handle; differentiable. Returns a list."""
    compressed = [compression.compress(t) for t in tensors]
    results = _GroupedReducescatter.apply(name, op, process_set, prescale_factor, postscale_factor,
                                          *[c for c, _ in compressed])
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(results, compressed)]


__all__ = ["allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "alltoall",
           "reducescatter", "grouped_reducescatter"]
