"""DistributedOptimizer: wrap any torch optimizer so that step() applies gradients averaged over all ranks.

    opt = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())

The wrapper only hooks and waits (as Horovod's); all communication goes through ringtrain.torch.functions, and
nothing here imports MPI, NCCL or cupy. Gradients travel in buckets, each bucket of one dtype as ONE flat tensor,
as torch DDP's with gradient_as_bucket_view: after the first step each .grad is a view of its bucket's persistent
buffer, so backward accumulates into the buffer and nothing is packed or unpacked. On CPU a gradient of 1 MB or more
travels alone, and every CPU buffer comes from ringtrain.torch.empty_shared: with the shm transport it lives in the
shared window, which is reduced in place with no copy-in or copy-out. Two schedules (`overlap=`):
- overlap: each bucket is submitted asynchronously from a hook as soon as its last gradient is final, so the
  communication of late layers overlaps the backward pass of early ones (the engine's thread runs it). After the
  first step only each bucket's last-ready parameter runs Python; the others' hooks are `list.append`.
- after backward: step() reduces every bucket synchronously on the caller's thread, one call per bucket. Where no
  core is free for the engine's thread (CPU training on every core), overlapping only makes the thread compete with
  backward; this schedule pays no thread wake-up and no per-parameter Python. The default (`overlap=None`) picks it
  on CPU when cores <= ranks on the node * (torch threads + 1), overlap otherwise (GPU); ranks agree on the choice.

Semantics worth knowing:
- backward_passes_per_step=k: k backward passes accumulate (sum) into .grad locally; the k-th submits the allreduce
  (after backward: step() does). More than k passes before step() is an error, raised by step()/synchronize().
- A parameter that required grad but got none this step (unused branch) is allreduced as zeros, so every rank
  submits the same set and nothing waits forever (Horovod does the same). Its .grad becomes the reduced tensor (zeros
  if no rank used it); stateful optimizers (momentum, Adam) may therefore still move it, identically on every rank.
- Parameters with requires_grad=False at construction (frozen) are not hooked and never communicated.
- zero_grad() between backward and step() is an error while an allreduce is in flight (overlap); with nothing in
  flight it drops the unreduced gradients and their pass count, as plain torch would. Gradients that are bucket
  views are zeroed, not set to None (set_to_none applies to the others); a .grad set to None or replaced by the user
  (model.zero_grad()) is copied into the bucket at the next step and becomes a view again.
- Uneven inputs: a rank out of data calls hvd.join(); until every rank has joined it contributes zeros to the others'
  allreduces, and op=Average still divides by the full world size (as torch DDP's join does), i.e. the step uses
  sum(gradients of ranks that still have data) / size. Broadcast parameters from the rank join() returns afterwards.
"""
import collections
import contextlib
import itertools
import operator
import os
import warnings

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ringtrain.errors import RingtrainError, TensorMismatchError
from ringtrain.model_check import describe_model_mismatch
from ringtrain.process_sets import global_process_set

from . import consistency, functions, shared
from .compression import Compression
from .functions import Average, Sum, as_op

_MB = 1 << 20
# on CPU a gradient this large travels alone: its own bucket, so it is reduced as soon as it is final and never waits
# for smaller neighbours (the extra request costs ~50 us)
_ALONE_BYTES = 1 << 20
_GRAD = operator.attrgetter("grad")
# names stay distinct when one process wraps several optimizers; counted per process set, so an optimizer that only
# a set's members create does not shift the names of the world's next optimizer on those ranks alone
_instance_counters = collections.defaultdict(itertools.count)


class _Bucket:
    __slots__ = ("index", "name", "params", "flat", "arrivals", "buffer", "views")

    def __init__(self, index, name, params):
        self.index, self.name, self.params = index, name, params
        # travels as one flat tensor: several parameters of one dtype on one device, or one on the CPU (its buffer
        # then lives in the shm window, which the transport reduces without copying it in or out)
        self.flat = (len({(p.dtype, p.device) for p in params}) == 1
                     and (len(params) > 1 or params[0].device.type == "cpu"))
        self.arrivals = []        # parameters whose gradient was accumulated this step (the hooks append)
        self.buffer = None        # persistent flat tensor the bucket travels in (made at its first flat submit)
        self.views = None         # views of buffer shaped like params: their .grad from then on

    def grads_are_views(self):
        # map/operator.is_ keep this per-step check in C: no Python frame per parameter
        return self.views is not None and all(map(operator.is_, map(_GRAD, self.params), self.views))


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


def _layout_buckets(params, first_bucket_bytes, bucket_bytes, alone_bytes=None, keep_order=True):
    """Split params (in expected ready order) into buckets: the first one small so the first allreduce starts early
    in backward, the rest up to bucket_bytes. A bucket holds one dtype and one device only. A CPU parameter of
    alone_bytes or more gets a bucket of its own. keep_order=True: buckets are consecutive runs of params (for
    overlap); False: small parameters of one kind fill the same bucket wherever they sit (reduced after backward,
    order does not matter, fewer requests)."""
    buckets, filling = [], {}       # (dtype, device) -> [params, bytes] of the bucket still filling

    def close(kind):
        buckets.append(filling.pop(kind)[0])

    for p in params:
        nbytes = p.numel() * p.element_size()
        kind = (p.dtype, p.device)
        if keep_order:
            for other in [k for k in filling if k != kind]:
                close(other)
        if alone_bytes is not None and nbytes >= alone_bytes and p.device.type == "cpu":
            if keep_order and kind in filling:
                close(kind)
            buckets.append([p])
            continue
        cap = first_bucket_bytes if not buckets else bucket_bytes
        current = filling.get(kind)
        if current is not None and current[1] + nbytes > cap:
            close(kind)
            cap = bucket_bytes
            current = None
        if current is None:
            current = filling[kind] = [[], 0]
        current[0].append(p)
        current[1] += nbytes
    for kind in list(filling):
        close(kind)
    return buckets


def default_overlap(params, ranks_on_node):
    """What overlap=None picks on this rank (ranks then agree: overlap only if all pick it). Overlap communication
    with backward only where the engine's thread can run beside the computation: on a GPU, or on a CPU with a core to
    spare per rank. On a CPU whose cores all compute, overlapping only makes that thread compete with backward."""
    if any(p.device.type != "cpu" for p in params):
        return True
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores >= ranks_on_node * (torch.get_num_threads() + 1)


def _describe_model_mismatch(per_rank):
    """per_rank[r] = [(name, shape, dtype, requires_grad), ...]; a message naming the first differences."""
    return describe_model_mismatch(
        per_rank, "DistributedOptimizer", "parameter",
        lambda spec: f"shape {spec[0]} {spec[1]} requires_grad={spec[2]}",
        "Every rank must build the same model and pass its parameters in the same order.")


class _DistributedOptimizerMixin:
    """Mixed in front of the wrapped optimizer's own class (see DistributedOptimizer)."""

    def _rt_setup(self, named_parameters, compression, backward_passes_per_step, op, gradient_predivide_factor,
                  bucket_cap_mb, first_bucket_mb, groups=None, sparse_as_dense=False, process_set=global_process_set,
                  overlap=None):
        op = as_op(op)        # op=Adasum raises UnsupportedOperationError here, at construction
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor} needs op=Average, got {op.name}")
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        if overlap not in (None, True, False):
            raise ValueError(f"overlap must be None (choose by hardware), True or False, got {overlap!r}")
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
        self._rt_params = [p for p in all_params if p.requires_grad]
        if overlap is None:
            overlap = default_overlap(self._rt_params, functions.local_size())
        self._rt_overlap = self._rt_check_same_model(all_params, overlap)
        self._rt_groups = _explicit_groups(self._rt_params, groups)
        # gradients arrive roughly in reverse definition order; with overlap, the order observed in step 1 then
        # replaces this guess (explicit groups are the user's buckets and stay as they are)
        self._rt_set_layout(list(reversed(self._rt_params)), generation=0)
        self._rt_layout_observed = self._rt_groups is not None or not self._rt_overlap
        self._rt_order_known = not self._rt_overlap   # overlap: step 1 watches which gradient of a bucket is last
        self._rt_should_synchronize = True
        self._rt_synchronized = False
        self._rt_steps = 0
        self._rt_hooks = []
        self._rt_reset_step()
        self._rt_install_hooks()

    @property
    def overlaps_backward(self):
        """True: buckets are allreduced during backward; False: step() reduces them after backward."""
        return self._rt_overlap

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

    def _rt_check_same_model(self, all_params, overlap):
        """One allgather_object at construction: a different model on some rank fails here on every rank, by name,
        instead of as a shape mismatch (or a hang) in the first backward. It also makes the schedule one choice for
        all ranks (overlap only where every rank chose it), so bucket layouts match."""
        mine = [(self._rt_names[id(p)], tuple(p.shape), str(p.dtype).replace("torch.", ""), p.requires_grad)
                for p in all_params]
        everyone = functions.allgather_object((mine, bool(overlap)), name=self._rt_prefix + ".model_check",
                                              process_set=self._rt_process_set)
        models = [entries for entries, _ in everyone]
        if any(entries != models[0] for entries in models):
            raise TensorMismatchError(_describe_model_mismatch(models))
        return all(choice for _, choice in everyone)

    def _rt_set_layout(self, ordered_params, generation):
        if self._rt_groups is not None:
            buckets = self._rt_groups
        elif self._rt_overlap:
            buckets = _layout_buckets(ordered_params, self._rt_first_bucket_bytes, self._rt_bucket_bytes,
                                      _ALONE_BYTES)
        else:   # reduced after backward: no reason for a small first bucket, and order does not matter
            buckets = _layout_buckets(ordered_params, self._rt_bucket_bytes, self._rt_bucket_bytes, _ALONE_BYTES,
                                      keep_order=False)
        self._rt_buckets = [_Bucket(i, f"{self._rt_prefix}.g{generation}.bucket{i}", params)
                            for i, params in enumerate(buckets)]
        self._rt_bucket_of = {id(p): b for b in self._rt_buckets for p in b.params}

    def _rt_install_hooks(self):
        """Post-accumulate-grad hooks. Until the ready order is known (overlap, step 1): a Python hook on every
        parameter. Then `bucket.arrivals.append` (a C call, no Python frame) on every parameter, except, with
        overlap, the bucket's last-ready one, whose hook submits the bucket once all its gradients are in."""
        for hook in self._rt_hooks:
            hook.remove()
        if not self._rt_order_known:
            self._rt_hooks = [p.register_post_accumulate_grad_hook(self._rt_first_step_hook)
                              for p in self._rt_params]
            return
        position = {id(p): i for i, p in enumerate(self._rt_ready_order)}
        hooks = []
        for bucket in self._rt_buckets:
            seen = [p for p in bucket.params if id(p) in position]
            last = max(seen, key=lambda p: position[id(p)]) if self._rt_overlap and seen else None
            for p in bucket.params:
                hook = self._rt_bucket_trigger(bucket) if p is last else bucket.arrivals.append
                hooks.append(p.register_post_accumulate_grad_hook(hook))
        self._rt_hooks = hooks

    def _rt_reset_step(self):
        for bucket in self._rt_buckets:
            bucket.arrivals.clear()   # cleared in place: the hooks hold these very lists
        self._rt_handles = {}          # bucket index -> (handle or None, grads, [(wire tensor, ctx)], flat or None)
        self._rt_sparse_handles = {}   # bucket index -> [(param, SparseHandle)] for sparse gradients
        self._rt_ready_order = []      # parameters in the order their gradient became final (step 1 of overlap)
        self._rt_first_step_counts = {}   # id(param) -> arrivals so far (step 1 of overlap)

    # ------------------------------------------------------------ the hooks: gradients become final

    def _rt_first_step_hook(self, param):
        bucket = self._rt_bucket_of[id(param)]
        bucket.arrivals.append(param)
        count = self._rt_first_step_counts[id(param)] = self._rt_first_step_counts.get(id(param), 0) + 1
        if count == self._rt_passes_per_step:
            self._rt_ready_order.append(param)
        self._rt_submit_if_complete(bucket)

    def _rt_bucket_trigger(self, bucket):
        arrivals = bucket.arrivals

        def last_gradient_of_bucket(param):
            arrivals.append(param)
            self._rt_submit_if_complete(bucket)
        return last_gradient_of_bucket

    def _rt_submit_if_complete(self, bucket):
        # every parameter arrives once per backward pass, so k passes make k * len(params) arrivals; a parameter
        # arriving more often is an error that synchronize() reports
        if (len(bucket.arrivals) == self._rt_passes_per_step * len(bucket.params)
                and bucket.index not in self._rt_handles):
            self._rt_submit(bucket, sync=False)

    def _rt_check_passes(self):
        passes = self._rt_passes_per_step
        for bucket in self._rt_buckets:
            if len(bucket.arrivals) <= passes:
                continue
            if passes == 1 and len(set(map(id, bucket.arrivals))) == len(bucket.arrivals):
                continue   # the common case, checked in C
            counts = collections.Counter(map(id, bucket.arrivals))
            key, count = counts.most_common(1)[0]
            if count > passes:
                raise RingtrainError(
                    f"gradient of {self._rt_names[key]!r} was computed {count} times, more than "
                    f"backward_passes_per_step={passes} times before step(); call step() or synchronize() after "
                    f"every {passes} backward passes (or raise backward_passes_per_step)")

    # ------------------------------------------------------------ communication

    def _rt_submit(self, bucket, sync):
        """Start (sync=False) or run on this thread (sync=True) the allreduce of one bucket; synchronize() waits."""
        if bucket.grads_are_views():
            # the steady state: backward accumulated straight into the bucket's buffer, nothing to pack
            grads, sparse, flat = bucket.views, [], bucket.buffer
        else:
            grads, sparse = self._rt_dense_grads(bucket)
            flat = None
            if bucket.flat and grads and (len(grads) > 1 or not sparse):
                # one copy into the persistent buffer, and .grad becomes views of it (DDP's gradient_as_bucket_view)
                # so later steps accumulate there; a bucket with sparse gradients this step: a one-off flat tensor
                flat = self._rt_into_buffer(bucket, grads) if not sparse else _flatten_dense_tensors(grads)
        # sparse gradients travel as Horovod's do: allgather of indices and values (or dense, sparse_as_dense=True)
        sparse_handles = [(p, functions.sparse_allreduce_async(p.grad, f"{bucket.name}.sparse{i}", self._rt_op,
                                                               self._rt_process_set))
                          for i, p in enumerate(sparse)]
        handle = None
        compressed = []
        if flat is not None:
            # the bucket travels as ONE flat tensor: one array for the engine, no per-tensor work below this line
            compressed = [self._rt_compression.compress(flat)]
            start = functions.allreduce_ if sync else functions.allreduce_async_
            result = start(compressed[0][0], name=bucket.name, op=self._rt_op,
                           process_set=self._rt_process_set, **self._rt_scales)
            handle = None if sync else result
        elif grads:
            compressed = [self._rt_compression.compress(g) for g in grads]
            wires = [wire for wire, _ in compressed]
            if sync and len(wires) == 1:   # one tensor: reduced in place, driven by this thread
                functions.allreduce_(wires[0], name=bucket.name, op=self._rt_op,
                                     process_set=self._rt_process_set, **self._rt_scales)
            else:
                handle = functions.grouped_allreduce_async_(wires, name=bucket.name, op=self._rt_op,
                                                            process_set=self._rt_process_set, **self._rt_scales)
        self._rt_handles[bucket.index] = (handle, grads, compressed, flat)
        if sparse_handles:
            self._rt_sparse_handles[bucket.index] = sparse_handles

    def _rt_dense_grads(self, bucket):
        """(dense gradients, parameters with sparse ones) of a bucket, zeros for a parameter without a gradient."""
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
        return grads, sparse

    @staticmethod
    def _rt_into_buffer(bucket, grads):
        """Copy the bucket's gradients into its persistent flat buffer and make each .grad a view of it."""
        if bucket.buffer is None:
            numel, like = sum(g.numel() for g in grads), grads[0]
            # on the CPU in the shm window when there is one: reduced where it lies, no copy-in or copy-out
            bucket.buffer = (shared.empty_shared(numel, dtype=like.dtype) if like.device.type == "cpu"
                             else torch.empty(numel, dtype=like.dtype, device=like.device))
            bucket.views = list(_unflatten_dense_tensors(bucket.buffer, grads))
        with torch.no_grad():
            torch._foreach_copy_(bucket.views, grads)
        for p, view in zip(bucket.params, bucket.views):
            p.grad = view
        return bucket.buffer

    # ------------------------------------------------------------ public API

    def _rt_pending(self):
        """A backward pass (or a submitted bucket) since the last synchronize."""
        return bool(self._rt_handles) or any(bucket.arrivals for bucket in self._rt_buckets)

    def synchronize(self):
        """Wait until every gradient has been allreduced (reducing what backward did not submit: all of them after
        backward, unused parameters, or a step() after fewer than backward_passes_per_step passes). Idempotent
        until the next backward."""
        if self._rt_synchronized and not self._rt_pending():
            return
        try:
            self._rt_check_passes()
        except RingtrainError:
            self._rt_drain_handles()   # nothing already in flight may write into a gradient later
            self._rt_reset_step()
            raise
        try:
            for bucket in self._rt_buckets:   # same order on every rank: leftovers go out deterministically
                if bucket.index not in self._rt_handles:
                    self._rt_submit(bucket, sync=not self._rt_overlap)
            self._rt_wait_handles()
            if not self._rt_order_known:
                self._rt_learn_order()
        except BaseException:
            # a failed collective (stall, shutdown) must not leave this optimizer waiting on dead handles forever:
            # the next backward starts clean, e.g. after hvd.shutdown() and hvd.init()
            self._rt_reset_step()
            raise
        self._rt_reset_step()
        self._rt_synchronized = True

    def _rt_drain_handles(self):
        for handle, *_ in self._rt_handles.values():
            if handle is not None:
                try:
                    handle.wait()
                except RingtrainError:
                    pass

    def _rt_wait_handles(self):
        with torch.no_grad():
            for index in sorted(self._rt_handles):
                handle, grads, compressed, flat = self._rt_handles[index]
                if handle is not None:
                    handle.wait()
                if flat is not None:
                    (wire, ctx), = compressed
                    if wire is not flat:
                        flat.copy_(self._rt_compression.decompress(wire, ctx))
                    if flat is not self._rt_buckets[index].buffer:   # a one-off flat tensor
                        torch._foreach_copy_(grads, _unflatten_dense_tensors(flat, grads))
                    continue
                for grad, (wire, ctx) in zip(grads, compressed):
                    if wire is not grad:
                        grad.copy_(self._rt_compression.decompress(wire, ctx))
            for index in sorted(self._rt_sparse_handles):
                for p, sparse_handle in self._rt_sparse_handles[index]:
                    p.grad = sparse_handle.wait()

    def _rt_learn_order(self):
        """After the first step with overlap: re-lay buckets in observed order (unless the user gave groups), then
        hook each bucket's last-ready parameter only."""
        if not self._rt_layout_observed:
            self._rt_rebuild_buckets_in_ready_order()
        self._rt_order_known = True
        self._rt_install_hooks()

    def _rt_rebuild_buckets_in_ready_order(self):
        """As torch DDP: after the first step, lay buckets out in the order gradients actually became final, so the
        first bucket really is ready first. Ranks may observe different orders, so rank 0's wins; it travels as an
        allreduce (Sum, other ranks contribute zeros) rather than a broadcast, which also works while ranks join."""
        self._rt_layout_observed = True
        position = {id(p): i for i, p in enumerate(self._rt_params)}
        mine = [position[id(p)] + 1 for p in self._rt_ready_order]
        mine += [0] * (len(self._rt_params) - len(mine))   # parameters unused in step 1 have no place yet
        first = self._rt_process_set.rank() == 0
        order = torch.tensor(mine if first else [0] * len(mine), dtype=torch.int64)
        functions.allreduce_(order, op=Sum, name=self._rt_prefix + ".bucket_order", process_set=self._rt_process_set)
        chosen = [i for i in order.tolist() if i]
        if not chosen:
            return   # rank 0 had already joined (all zeros): keep the current layout
        placed = set(chosen)
        unseen = [p for p in reversed(self._rt_params) if position[id(p)] + 1 not in placed]
        self._rt_set_layout([self._rt_params[i - 1] for i in chosen] + unseen, generation=1)

    def step(self, closure=None):
        if self._rt_should_synchronize:
            if self._rt_synchronized and not self._rt_pending():
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
        for bucket in self._rt_buckets:
            bucket.arrivals.clear()

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
        self._rt_reset_step()   # nothing in flight: the unreduced gradients and their pass count go
        # Gradients that are views of a bucket's buffer stay views, zeroed (as DDP's gradient_as_bucket_view): set to
        # None, the next backward would allocate fresh ones and step() would copy them back in. From step() on it
        # makes no difference: every trainable parameter then has a gradient (zeros if no rank used it).
        if all(bucket.views is None for bucket in self._rt_buckets):
            return super().zero_grad(set_to_none)
        # not in any bucket: frozen at construction (a parameter unfrozen later still has torch's semantics)
        others = [p for group in self.param_groups for p in group["params"] if id(p) not in self._rt_bucket_of]
        for bucket in self._rt_buckets:
            if bucket.views is None:
                others += bucket.params
                continue
            bucket.buffer.zero_()
            if not bucket.grads_are_views():
                others += [p for p, view in zip(bucket.params, bucket.views) if p.grad is not view]
        with torch.no_grad():
            for p in others:     # torch's own zero_grad for gradients that are not bucket views
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_()
                    p.grad.zero_()
        return None


_wrapper_classes = {}


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none, backward_passes_per_step=1,
                         op=Average, gradient_predivide_factor=1.0, num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=global_process_set, bucket_cap_mb=25, first_bucket_mb=1.0, overlap=None):
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
    overlap: True = allreduce buckets during backward, False = in step() after backward, None = choose by hardware
    (after backward on a CPU with no core to spare for the engine's thread, overlap otherwise); see the module doc.
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
                      bucket_cap_mb, first_bucket_mb, groups, sparse_as_dense, process_set, overlap)
    return wrapped
