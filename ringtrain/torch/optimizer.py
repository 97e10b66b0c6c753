"""DistributedOptimizer: wrap any torch optimizer so that step() applies gradients averaged over all ranks.

    opt = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())

The wrapper only hooks and waits (as Horovod's); all communication goes through ringtrain.torch.functions, and
nothing here imports MPI, NCCL or cupy. Gradients travel in buckets, each bucket of one dtype as ONE flat tensor,
as torch DDP's with gradient_as_bucket_view: after the first step each .grad is a view of its bucket's persistent
buffer, so backward accumulates into the buffer and nothing is packed or unpacked -- except, after backward, a host
bucket of large gradients (1 MB or more on average), which zero_grad() drops and step() refills: one pass over
them costs less than zeroing the bucket and adding into it (see _REFILL_MIN_TENSOR_BYTES). On CPU a gradient of 1 MB or more
travels alone with overlap, and after backward in a bucket of such gradients only (fewer buckets: each costs an
agreement cycle and two barriers). Every CPU buffer comes from ringtrain.torch.empty_shared: with the shm transport
it lives in the shared window, which is reduced in place with no copy-in or copy-out; a refilled bucket is
reduced from the fresh gradients straight into it (only the part peers read is copied in). Two schedules
(`overlap=`):
- overlap: each bucket is submitted asynchronously from a hook as soon as its last gradient is final, so the
  communication of late layers overlaps the backward pass of early ones (the engine's thread runs it). After the
  first step only each bucket's last-ready parameter runs Python; the others' hooks are `list.append`.
- after backward: step() reduces every bucket synchronously on the caller's thread, one call per bucket. Where no
  core is free for the engine's thread (CPU training on every core), overlapping only makes the thread compete with
  backward; this schedule pays no thread wake-up and no per-parameter Python, and after the first step hooks one
  parameter per bucket, to count backward passes (see hook_one_parameter_per_bucket). The default (`overlap=None`)
  picks it on CPU when cores <= ranks on the node * (torch threads + 1), overlap otherwise (GPU); ranks agree on the
  choice.

Semantics worth knowing:
- backward_passes_per_step=k: k backward passes accumulate (sum) into .grad locally; the k-th submits the allreduce
  (after backward: step() does). More than k passes before step() is an error, raised by step()/synchronize().
  After backward, from the second step on, passes are counted on one parameter per bucket of several (one whose
  gradient came in the first step): extra passes that leave it out go unnoticed, as does a backward after
  synchronize() that reaches none of them.
- A parameter that required grad but got none this step (unused branch) is allreduced as zeros, so every rank
  submits the same set and nothing waits forever (Horovod does the same). Its .grad becomes the reduced tensor (zeros
  if no rank used it); stateful optimizers (momentum, Adam) may therefore still move it, identically on every rank.
- Parameters with requires_grad=False at construction (frozen) are not hooked and never communicated.
- zero_grad() between backward and step() is an error while an allreduce is in flight (overlap); with nothing in
  flight it drops the unreduced gradients and their pass count, as plain torch would. Gradients that are bucket
  views are zeroed, not set to None (set_to_none applies to the others and to refilled buckets' gradients); a
  .grad set to None or replaced by the user (model.zero_grad()) is copied into the bucket at the next step and
  becomes a view again.
- Uneven inputs: a rank out of data calls hvd.join(); until every rank has joined it contributes zeros to the others'
  allreduces, and op=Average still divides by the full world size (as torch DDP's join does), i.e. the step uses
  sum(gradients of ranks that still have data) / size. Broadcast parameters from the rank join() returns afterwards.
"""
import contextlib
import warnings

import torch

from ringtrain.core.process_sets import global_process_set
from ringtrain.reducer.wrapping import adopt, wrapper_class

from . import consistency
from ringtrain.ops import is_adasum

from .adasum_optimizer import adasum_optimizer
from .compression import Compression
from .functions import Average
from .gradient_hooks import GradientHooks, clear_gradients
from .sharded import sharded_optimizer


class _DistributedOptimizerMixin:
    """Mixed in front of the wrapped optimizer's own class (see DistributedOptimizer). Its one attribute on the
    user's optimizer is `_ringtrain`, the GradientHooks that own the reducer."""

    @property
    def _parameter_names(self):
        """Horovod's parameter -> name mapping, which some scripts read: the names of named_parameters, else
        'allreduce.noname.<i>' numbered within each param group, as Horovod."""
        hooks = self._ringtrain
        if hooks.names_given:
            return {p: hooks.names[id(p)] for p in hooks.all_params()}
        return {p: f"allreduce.noname.{i}" for group in self.param_groups for i, p in enumerate(group["params"])}

    @property
    def overlaps_backward(self):
        """True: buckets are allreduced during backward; False: step() reduces them after backward."""
        return self._ringtrain.reducer.overlap

    def synchronize(self):
        """Wait until every gradient has been allreduced (reducing what backward did not submit: all of them after
        backward, unused parameters, or a step() after fewer than backward_passes_per_step passes). Idempotent
        until the next backward."""
        self._ringtrain.synchronize()

    def step(self, closure=None):
        hooks = self._ringtrain
        if hooks.should_synchronize:
            if hooks.reducer.is_synchronized():
                warnings.warn("optimizer.step() called after optimizer.synchronize() without "
                              "`with optimizer.skip_synchronize():`; gradients were not reduced twice, but wrap "
                              "the step in skip_synchronize() to say so", stacklevel=2)
            hooks.synchronize()
        hooks.reducer.prepare_for_backward()
        result = super().step(closure)
        hooks.steps += 1
        # RINGTRAIN_CHECK_EVERY=n: every n-th step, verify parameters are still identical on all ranks (collective;
        # do not combine with join(), where some ranks no longer step)
        consistency.maybe_check(hooks.steps, hooks.named_parameters, hooks.reducer.process_set)
        return result

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Use after an explicit synchronize() (e.g. to clip reduced gradients): step() then does not wait again."""
        self._ringtrain.should_synchronize = False
        try:
            yield
        finally:
            self._ringtrain.should_synchronize = True

    def set_backward_passes_per_step(self, passes):
        """Change how many backward passes accumulate locally before one allreduce (takes effect from the next
        backward pass; counts of the current one start over)."""
        self._ringtrain.reducer.set_passes_per_step(passes)

    def load_state_dict(self, state_dict):
        """Load optimizer state; gradients in flight are waited for and pending accumulation is dropped, so the
        next backward pass starts a fresh step (as after step())."""
        self._ringtrain.drop_pending()
        return super().load_state_dict(state_dict)

    def zero_grad(self, set_to_none=True):
        others = self._ringtrain.zero_grad(set_to_none)
        if others is None:
            return super().zero_grad(set_to_none)
        if others:
            clear_gradients(others, set_to_none)     # torch's own zero_grad for gradients that are not bucket views
        return None



class _OutsideTheSet:
    """The hooks of a DistributedOptimizer built on a rank outside its process set. As Horovod's: no gradient
    hooks, nothing reduced, step() is the optimizer's own (this rank trains alone)."""
    overlap = False

    def __init__(self, process_set, optimizer, named_parameters):
        self.process_set = process_set
        self.optimizer = optimizer
        self.names_given = named_parameters is not None
        self.names = {id(p): name for name, p in named_parameters} if self.names_given else {}
        self.reducer = self
        self.should_synchronize = True
        self.steps = 0

    def all_params(self):
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def synchronize(self):
        pass

    def is_synchronized(self):
        return False

    def prepare_for_backward(self):
        pass

    def set_passes_per_step(self, passes):
        pass

    def drop_pending(self):
        pass

    def zero_grad(self, set_to_none):
        return None

    def named_parameters(self):
        return []


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none, backward_passes_per_step=1,
                         op=Average, gradient_predivide_factor=1.0, num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=global_process_set, bucket_cap_mb=25, first_bucket_mb=1.0, overlap=None,
                         shard: "str | None" = None, gather_parameters: str = "step") -> torch.optim.Optimizer:
    """Return `optimizer` wrapped for data-parallel training: still an instance of its own class (isinstance works),
    with the same param_groups and state, whose step() first averages gradients over the ranks of `process_set`.

    named_parameters: model.named_parameters(), for readable error messages (default names param.<i>).
    compression: Compression.none | fp16 | bf16 for the wire. op: Average (default), Sum or Adasum (Horovod's Adasum
    optimizer: the ranks' local steps are combined, see ringtrain.torch.adasum_optimizer).
    groups (Horovod's): an int k = k buckets of near-equal parameter count, or lists of parameters, one bucket each
    (parameters in no list get a bucket each); num_groups is its older name. Without groups, buckets are laid out by
    size (bucket_cap_mb, first_bucket_mb small so communication starts early) and re-laid in observed order;
    reduced after backward, CPU gradients of 1 MB or more share buckets of their own of up to the larger of
    bucket_cap_mb and the fusion threshold (32 MB).
    sparse_as_dense: allreduce sparse gradients (nn.Embedding(sparse=True)) as dense tensors; by default they travel
    as an allgather of indices and values, as Horovod's.
    process_set: the ranks that train this model together (see add_process_set); every member must wrap it. On a
    rank outside the set (as Horovod) it is built but reduces nothing: step() is the plain optimizer's.
    overlap: True = allreduce buckets during backward, False = in step() after backward, None = choose by hardware
    (after backward on a CPU with no core to spare for the engine's thread, overlap otherwise); see the module doc.
    shard: None (every rank keeps the whole optimizer state), "optimizer" (ZeRO stage 1: each rank keeps and steps
    the state of 1/N of the parameters, then the ranks allgather them) or "gradients" (ZeRO stage 2: gradients are
    reduce-scattered too, so each rank also keeps only its shard of them). gather_parameters: "step" (step() returns
    with every parameter updated) or "forward" (the allgathers finish during the next forward). See
    ringtrain.torch.sharded.
    """
    if is_adasum(op):
        if shard is not None or gradient_predivide_factor != 1.0 or sparse_as_dense or groups or num_groups:
            raise ValueError("op=Adasum takes none of shard, gradient_predivide_factor, sparse_as_dense, groups and "
                             "num_groups (Horovod's Adasum optimizer reduces each parameter's step on its own)")
        if isinstance(optimizer, _DistributedOptimizerMixin):
            raise ValueError("this optimizer is already a DistributedOptimizer")
        return adasum_optimizer(optimizer, named_parameters, compression, backward_passes_per_step, process_set)
    if shard is not None:
        if groups is not None or num_groups or sparse_as_dense:
            raise ValueError("groups, num_groups and sparse_as_dense are not supported with shard=: a sharded "
                             "optimizer lays out its own buckets, and sparse gradients travel dense")
        return sharded_optimizer(optimizer, shard, named_parameters, compression, backward_passes_per_step, op,
                                 gradient_predivide_factor, process_set, bucket_cap_mb, first_bucket_mb, overlap,
                                 gather_parameters)
    if gather_parameters != "step":
        raise ValueError("gather_parameters applies to a sharded optimizer only (shard='optimizer' or "
                         "'gradients'): without sharding every rank updates every parameter itself")
    if isinstance(optimizer, _DistributedOptimizerMixin):
        raise ValueError("this optimizer is already a DistributedOptimizer")
    # same param_groups, state, defaults and hooks: the wrapper IS the user's optimizer, plus gradient hooks
    wrapped = adopt(wrapper_class(_DistributedOptimizerMixin, optimizer.__class__), optimizer)
    if num_groups and groups is None:
        groups = num_groups
    if process_set.included() is False:       # (None: not registered, which GradientHooks reports)
        wrapped._ringtrain = _OutsideTheSet(process_set, wrapped, named_parameters)
        return wrapped
    wrapped._ringtrain = GradientHooks(wrapped, named_parameters, compression, backward_passes_per_step, op,
                                       gradient_predivide_factor, bucket_cap_mb, first_bucket_mb, groups,
                                       sparse_as_dense, process_set, overlap)
    return wrapped

