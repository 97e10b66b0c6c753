"""DistributedOptimizer(op=Adasum): Horovod's Adasum optimizer. The ranks combine their local steps, not gradients.

    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), op=hvd.Adasum)

step() runs the wrapped optimizer on this rank's own gradients, takes each parameter's change (delta = new - old),
reduces the deltas with Adasum (per tensor: ringtrain.core.adasum) and sets every parameter to old + reduced delta,
so stateful optimizers (momentum, Adam) keep their state from local gradients, as Horovod's. Every parameter of the
param groups is reduced, a zero delta where it had no gradient, so all ranks reduce the same tensors. As Horovod's:
synchronize() does nothing, skip_synchronize() is an error, and more than backward_passes_per_step backward passes
before step() raise.
"""
import contextlib

import torch

from ringtrain.core.process_sets import global_process_set
from ringtrain.ops import Adasum
from ringtrain.reducer.reducer import instance_prefix
from ringtrain.reducer.wrapping import adopt, wrapper_class

from .compression import Compression
from .functions import grouped_allreduce_async_


class _AdasumState:
    def __init__(self, names, compression, passes, process_set):
        self.names, self.compression, self.passes, self.process_set = names, compression, passes, process_set
        # one name per optimizer, the same on every rank that builds the same optimizers in the same order
        self.name = instance_prefix("DistributedAdasumOptimizer", process_set) + ".deltas"
        self.counts = {}
        self.hooks = []


class _AdasumOptimizerMixin:
    """Mixed in front of the wrapped optimizer's class; its state is the `_ringtrain_adasum` attribute."""

    @property
    def _parameter_names(self):
        names = self._ringtrain_adasum.names
        return {p: names.get(id(p), f"allreduce.noname.{i}") for group in self.param_groups
                for i, p in enumerate(group["params"])}

    def synchronize(self):
        """Nothing to wait for: the reduction happens in step() (as Horovod's Adasum optimizer)."""

    @contextlib.contextmanager
    def skip_synchronize(self):
        raise AssertionError("Skipping synchronization is not supported when using Adasum optimizer.")
        yield  # pragma: no cover

    def step(self, closure=None):
        state = self._ringtrain_adasum
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        starts = [p.detach().clone() for p in params]
        super().step()
        with torch.no_grad():
            deltas, contexts = [], []
            for p, start in zip(params, starts):
                delta, ctx = state.compression.compress(p.detach() - start)
                deltas.append(delta.contiguous())
                contexts.append(ctx)
            if deltas and state.process_set.included() is not False:      # outside its set: a plain step
                grouped_allreduce_async_(deltas, op=Adasum, name=state.name,
                                         process_set=state.process_set).wait()
            for p, start, delta, ctx in zip(params, starts, deltas, contexts):
                p.copy_(start + state.compression.decompress(delta, ctx).to(p.dtype))
        state.counts.clear()
        return loss


def _count_passes(state, p):
    def hook(_param):
        state.counts[id(p)] = count = state.counts.get(id(p), 0) + 1
        if count > state.passes:
            raise AssertionError("Gradients were computed more than backward_passes_per_step times before call to "
                                 "step(). Increase backward_passes_per_step to accumulate gradients locally.")
    return hook


def adasum_optimizer(optimizer, named_parameters, compression=Compression.none, backward_passes_per_step=1,
                     process_set=global_process_set):
    """`optimizer` wrapped as above (still an instance of its own class, with the same param_groups and state)."""
    names = {}
    if named_parameters is not None:
        names = {id(p): name for name, p in named_parameters}
    state = _AdasumState(names, compression, int(backward_passes_per_step), process_set)
    wrapped = adopt(wrapper_class(_AdasumOptimizerMixin, optimizer.__class__), optimizer)
    wrapped._ringtrain_adasum = state
    for group in wrapped.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                state.hooks.append(p.register_post_accumulate_grad_hook(_count_passes(state, p)))
    return wrapped
