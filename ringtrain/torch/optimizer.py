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
import collections
import contextlib
import itertools
import warnings

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ringtrain.errors import RingtrainError, TensorMismatchError
from ringtrain.model_check import describe_model_mismatch
from ringtrain.process_sets import global_process_set

from . import consistency, functions
from .compression import Compression
from .functions import Average, Sum, as_op

_MB = 1 << 20
# names stay distinct when one process wraps several optimizers; counted per process set, so an optimizer that only
# a set's members create does not shift the names of the world's next optimizer on those ranks alone
_instance_counters = collections.defaultdict(itertools.count)


class _Bucket:
    __slots__ = ("index", "name", "params")

    def __init__(self, index, name, params):
        self.index, self.name, self.params = index, name, params


def _split_in_groups(params, num_groups):
    """Horovod's groups=<int>: the parameters in num_groups consecutive groups of near-equal count."""
    num_groups = min(int(num_groups), len(params))
    base, extra = divmod(len(params), num_groups) if num_groups else (0, 0)
    groups, start = [], 0
    for i in range(num_groups):
        end = start + base + (1 if i < extra else 0)
        groups.append(params[start:end])
        start = end
    return groups


def _explicit_groups(params, groups):
    """Horovod's groups=[[p, ...], ...]: each inner list is one group; parameters in no list form a group each.
    Returns None for no grouping (groups None or 0)."""
    if groups is None or (isinstance(groups, int) and not isinstance(groups, bool) and groups == 0):
        return None
    if isinstance(groups, int) and not isinstance(groups, bool):
        if groups < 0:
            raise ValueError(f"groups must be a non-negative int or a list of lists of parameters, got {groups}")
        return _split_in_groups(params, groups)
    wanted = {id(p) for p in params}
    chosen, seen = [], set()
    for group in groups:
        group = list(group)
        members = [p for p in group if id(p) in wanted and id(p) not in seen]
        if len(members) != len(group):
            raise ValueError("groups: every parameter must be a trainable parameter of this optimizer and appear in "
                             "one group only")
        seen.update(id(p) for p in members)
        if members:
            chosen.append(members)
    return chosen + [[p] for p in params if id(p) not in seen]


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
                  bucket_cap_mb, first_bucket_mb, groups=None, sparse_as_dense=False, process_set=global_process_set):
        op = as_op(op)        # op=Adasum raises UnsupportedOperationError here, at construction
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor} needs op=Average, got {op.name}")
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        self._rt_compression = compression
        self._rt_op = op
        self._rt_process_set = process_set
        self._rt_sparse_as_dense = bool(sparse_as_dense)
        self._rt_passes_per_step = int(backward_passes_per_step)
        # Average's 1/size is applied by the core; predividing splits it to keep fp16 sums in range (as Horovod)
        self._rt_scales = (dict(prescale_factor=1.0 / gradient_predivide_factor,
                                postscale_factor=gradient_predivide_factor)
                           if gradient_predivide_factor != 1.0 else {})
        set_id = process_set.process_set_id
        number = next(_instance_counters[set_id])
        self._rt_prefix = (f"DistributedOptimizer{number}" if set_id == 0
                           else f"DistributedOptimizer.set{set_id}.{number}")
        self._rt_bucket_bytes = int(bucket_cap_mb * _MB)
        self._rt_first_bucket_bytes = int(first_bucket_mb * _MB)

        all_params = [p for group in self.param_groups for p in group["params"]]
        self._rt_names = self._rt_name_parameters(all_params, named_parameters)
        self._rt_check_same_model(all_params)
        self._rt_params = [p for p in all_params if p.requires_grad]
        self._rt_groups = _explicit_groups(self._rt_params, groups)
        # gradients arrive roughly in reverse definition order; after step 1 the observed order replaces this guess
        # (explicit groups are the user's buckets and stay as they are)
        self._rt_set_layout(list(reversed(self._rt_params)), generation=0)
        self._rt_layout_observed = self._rt_groups is not None
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
        everyone = functions.allgather_object(mine, name=self._rt_prefix + ".model_check",
                                              process_set=self._rt_process_set)
        if any(entries != everyone[0] for entries in everyone):
            raise TensorMismatchError(_describe_model_mismatch(everyone))

    def _rt_set_layout(self, ordered_params, generation):
        if self._rt_groups is not None:
            buckets = self._rt_groups
        else:
            buckets = _layout_buckets(ordered_params, self._rt_first_bucket_bytes, self._rt_bucket_bytes)
        self._rt_buckets = [_Bucket(i, f"{self._rt_prefix}.g{generation}.bucket{i}", params)
                            for i, params in enumerate(buckets)]
        self._rt_bucket_of = {id(p): b.index for b in self._rt_buckets for p in b.params}

    def _rt_reset_step(self):
        self._rt_passes_left = {id(p): self._rt_passes_per_step for p in self._rt_params}
        self._rt_pending = [len(b.params) for b in self._rt_buckets]   # grads not yet final, per bucket
        self._rt_handles = {}          # bucket index -> (handle, grads, [(wire tensor, ctx)], flat bucket or None)
        self._rt_sparse_handles = {}   # bucket index -> [(param, SparseHandle)] for sparse gradients
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
        grads, sparse = [], []
        for p in bucket.params:
            if p.grad is None:     # no gradient this step: zeros keep every rank's bucket identical
                p.grad = torch.zeros_like(p)
            if p.grad.is_sparse:   # nn.Embedding(sparse=True)
                if not self._rt_sparse_as_dense:
                    sparse.append(p)
                    continue
                p.grad = p.grad.to_dense()
            grads.append(p.grad)
        handle = flat = None
        compressed = []
        if len(grads) > 1 and len({(g.dtype, g.device) for g in grads}) == 1:
            # DDP's trick: the bucket travels as ONE flat tensor -- packed by one C++ call, one array for the engine
            # (no per-tensor work below this line), copied back by one _foreach_copy_ in synchronize()
            flat = _flatten_dense_tensors(grads)
            compressed = [self._rt_compression.compress(flat)]
            handle = functions.allreduce_async_(compressed[0][0], name=bucket.name, op=self._rt_op,
                                                process_set=self._rt_process_set, **self._rt_scales)
        elif grads:
            compressed = [self._rt_compression.compress(g) for g in grads]
            handle = functions.grouped_allreduce_async_([wire for wire, _ in compressed], name=bucket.name,
                                                        op=self._rt_op, process_set=self._rt_process_set,
                                                        **self._rt_scales)
        # sparse gradients travel as Horovod's do: allgather of indices and values (or dense, sparse_as_dense=True)
        sparse_handles = [(p, functions.sparse_allreduce_async(p.grad, f"{bucket.name}.sparse{i}", self._rt_op,
                                                               self._rt_process_set))
                          for i, p in enumerate(sparse)]
        self._rt_handles[bucket.index] = (handle, grads, compressed, flat)
        if sparse_handles:
            self._rt_sparse_handles[bucket.index] = sparse_handles
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
        try:
            self._rt_wait_handles()
            if not self._rt_layout_observed:
                self._rt_rebuild_buckets_in_ready_order()
        except BaseException:
            # a failed collective (stall, shutdown) must not leave this optimizer waiting on dead handles forever:
            # the next backward starts clean, e.g. after hvd.shutdown() and hvd.init()
            self._rt_reset_step()
            raise
        self._rt_reset_step()
        self._rt_synchronized = True

    def _rt_wait_handles(self):
        with torch.no_grad():
            for index in sorted(self._rt_handles):
                handle, grads, compressed, flat = self._rt_handles[index]
                if handle is not None:
                    handle.wait()
                if flat is not None:
                    (wire, ctx), = compressed
                    reduced = flat if wire is flat else self._rt_compression.decompress(wire, ctx)
                    torch._foreach_copy_(grads, _unflatten_dense_tensors(reduced, grads))
                    continue
                for grad, (wire, ctx) in zip(grads, compressed):
                    if wire is not grad:
                        grad.copy_(self._rt_compression.decompress(wire, ctx))
                for p, sparse_handle in self._rt_sparse_handles.get(index, ()):
                    p.grad = sparse_handle.wait()

    def _rt_rebuild_buckets_in_ready_order(self):
        """As torch DDP: after the first step, lay buckets out in the order gradients actually became final, so the
        first bucket really is ready first. Ranks may observe different orders, so rank 0's wins; it travels as an
        allreduce (Sum, other ranks contribute zeros) rather than a broadcast, which also works while ranks join."""
        self._rt_layout_observed = True
        position = {id(p): i for i, p in enumerate(self._rt_params)}
        mine = [position[id(p)] + 1 for p in self._rt_ready_order]
        first = self._rt_process_set.rank() == 0
        order = torch.tensor(mine if first else [0] * len(mine), dtype=torch.int64)
        functions.allreduce_(order, op=Sum, name=self._rt_prefix + ".bucket_order", process_set=self._rt_process_set)
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
        consistency.maybe_check(self._rt_steps, self._rt_named_parameters, self._rt_process_set)
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

    def set_backward_passes_per_step(self, passes):
        """Change how many backward passes accumulate locally before one allreduce (takes effect from the next
        backward pass; counts of the current one start over)."""
        if int(passes) < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {passes}")
        self._rt_passes_per_step = int(passes)
        self._rt_passes_left = {id(p): self._rt_passes_per_step for p in self._rt_params}

    def load_state_dict(self, state_dict):
        """Load optimizer state; gradients in flight are waited for and pending accumulation is dropped, so the
        next backward pass starts a fresh step (as after step())."""
        if self._rt_handles:
            try:
                self._rt_wait_handles()
            finally:
                self._rt_reset_step()
        self._rt_reset_step()
        self._rt_synchronized = False
        return super().load_state_dict(state_dict)

    def _rt_only_failed_handles(self):
        """True when every pending allreduce has ended in an error (e.g. the engine failed and was shut down):
        nothing writes into the gradients any more, so the pending step can simply be dropped."""
        for handle, *_ in self._rt_handles.values():
            if handle is None:
                continue
            if not handle.poll():
                return False
            try:
                handle.wait()
                return False        # a successful result is still owed to the gradients by step()
            except RingtrainError:
                pass
        return True

    def zero_grad(self, set_to_none=True):
        if self._rt_handles and self._rt_only_failed_handles():
            self._rt_reset_step()
        if self._rt_handles:
            raise RingtrainError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                "optimizer.synchronize(): allreduces are still writing into the gradients "
                f"(buckets {sorted(self._rt_handles)})")
        return super().zero_grad(set_to_none)


_wrapper_classes = {}


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none, backward_passes_per_step=1,
                         op=Average, gradient_predivide_factor=1.0, num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=global_process_set, bucket_cap_mb=25, first_bucket_mb=1.0):
    """Return `optimizer` wrapped for data-parallel training: still an instance of its own class (isinstance works),
    with the same param_groups and state, whose step() first averages gradients over the ranks of `process_set`.

    named_parameters: model.named_parameters(), for readable error messages (default names param.<i>).
    compression: Compression.none | fp16 | bf16 for the wire. op: Average (default) or Sum (Adasum: not yet).
    groups (Horovod's): an int k = k buckets of near-equal parameter count, or lists of parameters, one bucket each
    (parameters in no list get a bucket each); num_groups is its older name. Without groups, buckets are laid out by
    size (bucket_cap_mb, first_bucket_mb small so communication starts early) and re-laid in observed order.
    sparse_as_dense: allreduce sparse gradients (nn.Embedding(sparse=True)) as dense tensors; by default they travel
    as an allgather of indices and values, as Horovod's.
    process_set: the ranks that train this model together (see add_process_set); every member must wrap it.
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
    if num_groups and groups is None:
        groups = num_groups
    wrapped._rt_setup(named_parameters, compression, backward_passes_per_step, op, gradient_predivide_factor,
                      bucket_cap_mb, first_bucket_mb, groups, sparse_as_dense, process_set)
    return wrapped
