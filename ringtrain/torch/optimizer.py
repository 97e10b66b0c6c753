"""DistributedOptimizer: wrap any torch optimizer so that step() applies gradients averaged over all ranks.

    opt = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())

The wrapper only hooks and waits (as Horovod's): a post-accumulate-grad hook per parameter notes when its gradient is
final; when every gradient of a bucket is final the bucket is submitted as one grouped in-place allreduce, so the
communication of late layers overlaps the backward pass of early ones. step() waits for the handles, then steps.
All communication goes through ringtrain.torch.functions; nothing here imports MPI, NCCL or cupy.

Semantics worth knowing:
- backward_passes_per_step=k: k backward passes accumulate (sum) into .grad locally; the k-th submits the allreduce.
- A parameter that required grad but got none this step (unused branch) is allreduced as zeros, so every rank
  submits the same set and nothing waits forever (Horovod does the same). Its .grad becomes the reduced tensor (zeros
  if no rank used it); stateful optimizers (momentum, Adam) may therefore still move it, identically on every rank.
- Parameters with requires_grad=False at construction (frozen) are not hooked and never communicated.
- Uneven inputs: a rank out of data calls hvd.join(); until every rank has joined it contributes zeros to the others'
  allreduces, and op=Average still divides by the full world size (as torch DDP's join does), i.e. the step uses
  sum(gradients of ranks that still have data) / size. Broadcast parameters from the rank join() returns afterwards.
"""
import contextlib
import itertools
import warnings

import torch

from ringtrain.errors import RingtrainError, TensorMismatchError
from ringtrain.model_check import describe_model_mismatch

from . import consistency, functions
from .compression import Compression
from .functions import Average, Sum, as_op

_MB = 1 << 20
_instance_counter = itertools.count()   # names stay distinct when one process wraps several optimizers


class _Bucket:
    __slots__ = ("index", "name", "params")

    def __init__(self, index, name, params):
        self.index, self.name, self.params = index, name, params


def _layout_buckets(params, first_bucket_bytes, bucket_bytes):
    """Split params (in expected ready order) into consecutive buckets: the first one small so the first allreduce
    starts early in backward, the rest up to bucket_bytes. A bucket holds one dtype and one device only."""
    buckets, current, current_bytes, cap = [], [], 0, first_bucket_bytes
    for p in params:
        nbytes = p.numel() * p.element_size()
        if current and (current_bytes + nbytes > cap or p.dtype != current[0].dtype or p.device != current[0].device):
            buckets.append(current)
            current, current_bytes, cap = [], 0, bucket_bytes
        current.append(p)
        current_bytes += nbytes
    if current:
        buckets.append(current)
    return buckets


def _describe_model_mismatch(per_rank):
    """per_rank[r] = [(name, shape, dtype, requires_grad), ...]; a message naming the first differences."""
    return describe_model_mismatch(
        per_rank, "DistributedOptimizer", "parameter",
        lambda spec: f"shape {spec[0]} {spec[1]} requires_grad={spec[2]}",
        "Every rank must build the same model and pass its parameters in the same order.")


class _DistributedOptimizerMixin:
    """Mixed in front of the wrapped optimizer's own class (see DistributedOptimizer)."""

    def _rt_setup(self, named_parameters, compression, backward_passes_per_step, op, gradient_predivide_factor,
                  bucket_cap_mb, first_bucket_mb):
        op = as_op(op)
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor} needs op=Average, got {op.name}")
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        self._rt_compression = compression
        self._rt_op = op
        self._rt_passes_per_step = int(backward_passes_per_step)
        # Average's 1/size is applied by the core; predividing splits it to keep fp16 sums in range (as Horovod)
        self._rt_scales = (dict(prescale_factor=1.0 / gradient_predivide_factor,
                                postscale_factor=gradient_predivide_factor)
                           if gradient_predivide_factor != 1.0 else {})
        self._rt_prefix = f"DistributedOptimizer{next(_instance_counter)}"
        self._rt_bucket_bytes = int(bucket_cap_mb * _MB)
        self._rt_first_bucket_bytes = int(first_bucket_mb * _MB)

        all_params = [p for group in self.param_groups for p in group["params"]]
        self._rt_names = self._rt_name_parameters(all_params, named_parameters)
        self._rt_check_same_model(all_params)
        self._rt_params = [p for p in all_params if p.requires_grad]
        # gradients arrive roughly in reverse definition order; after step 1 the observed order replaces this guess
        self._rt_set_layout(list(reversed(self._rt_params)), generation=0)
        self._rt_layout_observed = False
        self._rt_should_synchronize = True
        self._rt_synchronized = False
        self._rt_steps = 0
        self._rt_reset_step()
        self._rt_hooks = [p.register_post_accumulate_grad_hook(self._rt_grad_ready) for p in self._rt_params]

    # ------------------------------------------------------------ construction helpers

    @staticmethod
    def _rt_name_parameters(all_params, named_parameters):
        """id(param) -> name; names come from named_parameters (Horovod's rule: all or none) or param.<group>.<i>."""
        if named_parameters is None:
            return {id(p): f"param.{i}" for i, p in enumerate(all_params)}
        named = list(named_parameters)
        names = [name for name, _ in named]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"named_parameters has duplicate names {duplicates[:5]}; names must be unique")
        by_id = {id(p): name for name, p in named}
        unnamed = [i for i, p in enumerate(all_params) if id(p) not in by_id]
        if unnamed:
            raise ValueError(f"{len(unnamed)} optimizer parameters (positions {unnamed[:5]}) are missing from "
                             "named_parameters; pass model.named_parameters() of the model the optimizer trains")
        return by_id

    def _rt_check_same_model(self, all_params):
        """One allgather_object at construction: a different model on some rank fails here on every rank, by name,
        instead of as a shape mismatch (or a hang) in the first backward."""
        mine = [(self._rt_names[id(p)], tuple(p.shape), str(p.dtype).replace("torch.", ""), p.requires_grad)
                for p in all_params]
        everyone = functions.allgather_object(mine, name=self._rt_prefix + ".model_check")
        if any(entries != everyone[0] for entries in everyone):
            raise TensorMismatchError(_describe_model_mismatch(everyone))

    def _rt_set_layout(self, ordered_params, generation):
        buckets = _layout_buckets(ordered_params, self._rt_first_bucket_bytes, self._rt_bucket_bytes)
        self._rt_buckets = [_Bucket(i, f"{self._rt_prefix}.g{generation}.bucket{i}", params)
                            for i, params in enumerate(buckets)]
        self._rt_bucket_of = {id(p): b.index for b in self._rt_buckets for p in b.params}

    def _rt_reset_step(self):
        self._rt_passes_left = {id(p): self._rt_passes_per_step for p in self._rt_params}
        self._rt_pending = [len(b.params) for b in self._rt_buckets]   # grads not yet final, per bucket
        self._rt_handles = {}          # bucket index -> (handle, grads, [(wire tensor, ctx)])
        self._rt_ready_order = []      # param indices in the order their gradient became final (first step only)
        self._rt_active = False        # a hook fired (or a bucket went out) since the last synchronize

    # ------------------------------------------------------------ the hook: gradients become final

    def _rt_grad_ready(self, param):
        self._rt_active = True
        key = id(param)
        left = self._rt_passes_left[key]
        if left == 0:
            raise RingtrainError(
                f"gradient of {self._rt_names[key]!r} was computed more than backward_passes_per_step="
                f"{self._rt_passes_per_step} times before step(); call step() or synchronize() after every "
                f"{self._rt_passes_per_step} backward passes (or raise backward_passes_per_step)")
        self._rt_passes_left[key] = left - 1
        if left == 1:
            self._rt_mark_final(param)

    def _rt_mark_final(self, param):
        if not self._rt_layout_observed:
            self._rt_ready_order.append(param)
        index = self._rt_bucket_of[id(param)]
        self._rt_pending[index] -= 1
        if self._rt_pending[index] == 0:
            self._rt_submit(self._rt_buckets[index])

    def _rt_submit(self, bucket):
        grads = []
        for p in bucket.params:
            if p.grad is None:     # no gradient this step: zeros keep every rank's bucket identical
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        compressed = [self._rt_compression.compress(g) for g in grads]
        handle = functions.grouped_allreduce_async_([wire for wire, _ in compressed], name=bucket.name,
                                                    op=self._rt_op, **self._rt_scales)
        self._rt_handles[bucket.index] = (handle, grads, compressed)
        self._rt_active = True

    # ------------------------------------------------------------ public API

    def synchronize(self):
        """Wait until every gradient has been allreduced (submitting what backward did not: unused parameters,
        or a step() after fewer than backward_passes_per_step passes). Idempotent until the next backward."""
        if self._rt_synchronized and not self._rt_active:
            return
        for p in self._rt_params:   # same order on every rank: leftovers go out deterministically
            if self._rt_passes_left[id(p)] > 0:
                self._rt_passes_left[id(p)] = 0
                self._rt_mark_final(p)
        with torch.no_grad():
            for index in sorted(self._rt_handles):
                handle, grads, compressed = self._rt_handles[index]
                handle.wait()
                for grad, (wire, ctx) in zip(grads, compressed):
                    if wire is not grad:
                        grad.copy_(self._rt_compression.decompress(wire, ctx))
        if not self._rt_layout_observed:
            self._rt_rebuild_buckets_in_ready_order()
        self._rt_reset_step()
        self._rt_synchronized = True

    def _rt_rebuild_buckets_in_ready_order(self):
        """As torch DDP: after the first step, lay buckets out in the order gradients actually became final, so the
        first bucket really is ready first. Ranks may observe different orders, so rank 0's wins; it travels as an
        allreduce (Sum, other ranks contribute zeros) rather than a broadcast, which also works while ranks join."""
        self._rt_layout_observed = True
        position = {id(p): i for i, p in enumerate(self._rt_params)}
        mine = [position[id(p)] + 1 for p in self._rt_ready_order]
        order = torch.tensor(mine if functions.rank() == 0 else [0] * len(mine), dtype=torch.int64)
        functions.allreduce_(order, op=Sum, name=self._rt_prefix + ".bucket_order")
        chosen = order.tolist()
        if sorted(chosen) != list(range(1, len(self._rt_params) + 1)):
            return   # rank 0 had already joined (all zeros): keep the current layout
        self._rt_set_layout([self._rt_params[i - 1] for i in chosen], generation=1)

    def step(self, closure=None):
        if self._rt_should_synchronize:
            if self._rt_synchronized and not self._rt_active:
                warnings.warn("optimizer.step() called after optimizer.synchronize() without "
                              "`with optimizer.skip_synchronize():`; gradients were not reduced twice, but wrap "
                              "the step in skip_synchronize() to say so", stacklevel=2)
            self.synchronize()
        self._rt_synchronized = False
        result = super().step(closure)
        self._rt_steps += 1
        # RINGTRAIN_CHECK_EVERY=n: every n-th step, verify parameters are still identical on all ranks (collective;
        # do not combine with join(), where some ranks no longer step)
        consistency.maybe_check(self._rt_steps, self._rt_named_parameters)
        return result

    def _rt_named_parameters(self):
        return [(self._rt_names[id(p)], p) for group in self.param_groups for p in group["params"]]

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Use after an explicit synchronize() (e.g. to clip reduced gradients): step() then does not wait again."""
        self._rt_should_synchronize = False
        try:
            yield
        finally:
            self._rt_should_synchronize = True

    def zero_grad(self, set_to_none=True):
        if self._rt_handles:
            raise RingtrainError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                "optimizer.synchronize(): allreduces are still writing into the gradients "
                f"(buckets {sorted(self._rt_handles)})")
        return super().zero_grad(set_to_none)


_wrapper_classes = {}


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none, backward_passes_per_step=1,
                         op=Average, gradient_predivide_factor=1.0, bucket_cap_mb=25, first_bucket_mb=1.0):
    """Return `optimizer` wrapped for data-parallel training: still an instance of its own class (isinstance works),
    with the same param_groups and state, whose step() first averages gradients over all ranks.

    named_parameters: model.named_parameters(), for readable error messages (default names param.<i>).
    compression: Compression.none | fp16 | bf16 for the wire. op: Average (default) or Sum.
    bucket_cap_mb / first_bucket_mb: fusion sizes (the first bucket small so communication starts early).
    """
    base = optimizer.__class__
    if isinstance(optimizer, _DistributedOptimizerMixin):
        raise ValueError("this optimizer is already a DistributedOptimizer")
    cls = _wrapper_classes.get(base)
    if cls is None:
        cls = _wrapper_classes[base] = type(base.__name__, (_DistributedOptimizerMixin, base), {})
    wrapped = cls.__new__(cls)
    # same param_groups, state, defaults and hooks: the wrapper IS the user's optimizer, plus gradient hooks
    wrapped.__dict__.update(optimizer.__dict__)
    wrapped._rt_setup(named_parameters, compression, backward_passes_per_step, op, gradient_predivide_factor,
                      bucket_cap_mb, first_bucket_mb)
    return wrapped
