"""The torch side of the Reducer for one DistributedOptimizer: post-accumulate-grad hooks that report each gradient
to the Reducer, the buckets' flat buffers (each .grad a view of one) and the tensor <-> array handover.

Gradients travel in buckets, each bucket of one dtype as ONE flat tensor, as torch DDP's with
gradient_as_bucket_view: after the first step each .grad is a view of its bucket's persistent buffer, so backward
accumulates into the buffer and nothing is packed or unpacked -- except, after backward, a host bucket of large
gradients (1 MB or more on average), which zero_grad() drops and step() refills: one pass over them costs less than
zeroing the bucket and adding into it (see _REFILL_MIN_TENSOR_BYTES). On CPU a gradient of 1 MB or more travels
alone with overlap, and after backward in a bucket of such gradients only (fewer buckets: each costs an agreement
cycle and two barriers). Every CPU buffer comes from ringtrain.torch.empty_shared: with the shm transport it lives
in the shared window, which is reduced in place with no copy-in or copy-out; a refilled bucket is reduced from the
fresh gradients straight into it (only the part peers read is copied in). Nothing here imports MPI, NCCL or cupy.
"""
import functools
import operator
import os

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ringtrain import host_memory
from ringtrain.core import state as core_state
from ringtrain.errors import TensorMismatchError
from ringtrain.reducer.model_check import describe_model_mismatch
from ringtrain.reducer.reducer import Member, Phase, Reducer, Scaling, instance_prefix

from . import functions, shared
from .functions import contiguous, copy_back, to_array

_MB = 1 << 20
# on CPU a gradient this large is large (see plan_buckets): with overlap it travels alone, its own bucket, so it is
# reduced as soon as it is final and never waits for smaller neighbours (the extra request costs ~50 us); after
# backward it shares buckets with large ones only (ResNet-18: two buckets instead of nine, 2-3 points of a step),
# up to the fusion threshold (the shm window's capacity, which a bucket's collective passes in one piece) where
# that is more than bucket_cap_mb: each bucket fewer saves an agreement cycle and two barriers
_ALONE_BYTES = 1 << 20
# After backward, a host bucket whose gradients average this many bytes or more is refilled every step instead of
# keeping its gradients as views: zero_grad(set_to_none=True) drops them, backward hands its fresh gradients over
# to .grad (no add), and submission reduces them from where they lie into the bucket. A view costs more per byte
# -- zero_grad() writes the bucket, and backward adds into it (two reads, one write) -- but less per tensor, where
# hundreds of small gradients make each copy's overhead count. Same-run A/B, 2 ranks (views -> refilled):
# ResNet-18 150.0 -> 139.7 ms per step, convnet 118.9 -> 117.8 ms; the MLP's 402 small gradients stay views.
_REFILL_MIN_TENSOR_BYTES = 1 << 20
_GRAD = operator.attrgetter("grad")


def parameter_members(params, names):
    """The reducer's view of torch parameters: key, name, bytes, kind (dtype, device), on the host or not."""
    return [Member(p, names[id(p)], p.numel() * p.element_size(), (p.dtype, p.device), p.device.type == "cpu")
            for p in params]


def _grads_are_views(bucket):
    # map/operator.is_ keep this per-step check in C: no Python frame per parameter
    return (bucket.views is not None
            and all(map(operator.is_, map(_GRAD, bucket.keys), bucket.views)))


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


def _name_parameters(all_params, named_parameters):
    """id(param) -> name; names come from named_parameters (Horovod's rule: all or none) or param.<i>."""
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


def _check_same_model(all_params, names, overlap, prefix, process_set):
    """One allgather_object at construction: a different model on some rank fails here on every rank, by name,
    instead of as a shape mismatch (or a hang) in the first backward. It also makes the schedule one choice for
    all ranks (overlap only where every rank chose it), so bucket layouts match."""
    mine = [(names[id(p)], tuple(p.shape), str(p.dtype).replace("torch.", ""), p.requires_grad) for p in all_params]
    everyone = functions.allgather_object((mine, bool(overlap)), name=prefix + ".model_check",
                                          process_set=process_set)
    models = [entries for entries, _ in everyone]
    if any(entries != models[0] for entries in models):
        raise TensorMismatchError(_describe_model_mismatch(models))
    return all(choice for _, choice in everyone)


def _grad_accumulator(param):
    """The autograd node that accumulates `param`'s gradient (torch makes one per forward unless it is held)."""
    with torch.enable_grad():
        return param.view_as(param).grad_fn.next_functions[0][0]


def _accumulated(arrived, param, _grad_inputs, _grad_outputs):
    """A gradient accumulator's post hook: `param`'s gradient is in .grad."""
    arrived(param)


class GradientHooks:
    """The torch side of the reducer for one optimizer: post-accumulate-grad hooks that report each gradient to the
    Reducer, the buckets' flat buffers (each .grad a view of one), and the tensor <-> array hand-over. Held by the
    wrapped optimizer as its one ringtrain attribute."""

    node_hooks_first_step = True    # after backward, step 1: hooks on gradient accumulators (see install_hooks)

    def __init__(self, optimizer, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, bucket_cap_mb, first_bucket_mb, groups, sparse_as_dense, process_set,
                 overlap):
        scaling = Scaling.for_gradients(op, gradient_predivide_factor)
        if overlap not in (None, True, False):
            raise ValueError(f"overlap must be None (choose by hardware), True or False, got {overlap!r}")
        if int(backward_passes_per_step) < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        self.optimizer = optimizer
        self.sparse_as_dense = bool(sparse_as_dense)
        self.should_synchronize = True      # False inside skip_synchronize()
        self.steps = 0
        self.hooks = []
        prefix = instance_prefix("DistributedOptimizer", process_set)
        all_params = self.all_params()
        self.names_given = named_parameters is not None
        self.names = _name_parameters(all_params, named_parameters)
        params = [p for p in all_params if p.requires_grad]
        if overlap is None:
            overlap = default_overlap(params, functions.local_size())
        if not core_state.config().elastic:
            # a collective: not in an elastic job, where a worker that joins builds its optimizer while the others
            # train (sync() then hands it their state); overlap is there each rank's own choice, the same on every
            # rank since each rank of an elastic world is a node of its own
            overlap = _check_same_model(all_params, self.names, overlap, prefix, process_set)
        self.reducer = Reducer(parameter_members(params, self.names), prefix=prefix, scaling=scaling,
                               compression=compression, process_set=process_set,
                               passes_per_step=backward_passes_per_step, bucket_bytes=int(bucket_cap_mb * _MB),
                               first_bucket_bytes=int(first_bucket_mb * _MB), alone_bytes=_ALONE_BYTES,
                               large_bucket_bytes=max(int(bucket_cap_mb * _MB), core_state.config().fusion_threshold),
                               overlap=overlap, groups=groups, launch=self._launch)
        host = [m.nbytes for m in self.reducer.members if m.host]
        if host:
            # backward frees and makes each large host gradient again every step: keep those blocks in the heap
            host_memory.keep_freed_blocks(max(host), sum(host))
        self.refill_min_tensor_bytes = _REFILL_MIN_TENSOR_BYTES
        self._refilled = {}                 # bucket name -> refilled every step (see _REFILL_MIN_TENSOR_BYTES)
        self.counted = None                 # after backward: bucket name -> its one hooked parameter (from step 2)
        self._accumulators = []
        self._arrays = {}                   # bucket name -> (its buffer, the numpy array of it the engine reduces)
        self._unbucketed = ((), [])         # (param_groups' lists and lengths, their parameters in no bucket)
        self.install_hooks()

    def all_params(self):
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def named_parameters(self):
        return [(self.names[id(p)], p) for p in self.all_params()]

    # ------------------------------------------------------------ hooks: gradients become final

    def restart(self):
        """A new world (elastic): the reducer's first-step plan again, and its hooks (see Reducer.restart)."""
        self.reducer.restart()
        self.counted = None
        self.install_hooks()

    def install_hooks(self):
        """Post-accumulate-grad hooks. Until the ready order is known (overlap, step 1): a Python hook on every
        parameter. Then `bucket.arrivals.append` (a C call, no Python frame) on every parameter, except, with
        overlap, the bucket's last-ready one, whose hook submits the bucket once all its gradients are in.
        After backward, from the second step on, one parameter per bucket is hooked (hook_one_parameter_per_bucket)."""
        for hook in self.hooks:
            hook.remove()
        reducer = self.reducer
        if reducer.phase is Phase.LEARNING_ORDER:
            self.hooks = [m.key.register_post_accumulate_grad_hook(reducer.gradient_ready) for m in reducer.members]
            return
        hooks, accumulators = [], []
        first_step = not reducer.overlap and self.counted is None and self.node_hooks_first_step
        for bucket in reducer.buckets:
            last = reducer.last_ready(bucket)
            counted = self.counted.get(bucket.name) if self.counted else None
            for member in bucket.members:
                if counted is not None and member.key is not counted:
                    continue
                hook = reducer.trigger(bucket) if member is last else bucket.arrivals.append
                if first_step and len(bucket.members) > 1:
                    # hooked for this step only: a parameter's own hook, once registered, costs ~0.6 us per
                    # backward pass even after it is removed (torch keeps calling into Python for it: 0.2-0.3 ms
                    # of every backward for 402 parameters); a hook on its gradient accumulator goes with the
                    # accumulator, which the next forward makes anew once nothing holds it (see _accumulators)
                    accumulator = _grad_accumulator(member.key)
                    accumulators.append(accumulator)
                    hooks.append(accumulator.register_hook(functools.partial(_accumulated, hook, member.key)))
                else:
                    hooks.append(member.key.register_post_accumulate_grad_hook(hook))
        self.hooks = hooks
        self._accumulators = accumulators   # held while their hooks count: the forward passes then use them

    def hook_one_parameter_per_bucket(self):
        """After backward, the hooks only count backward passes: nothing is submitted before step(). A hook costs
        ~0.5 us per parameter per pass (402 small parameters: 0.2 ms, 2% of a step), so after the first step one
        parameter per bucket counts the passes of its bucket -- of those whose gradient came in the first step, the
        last to come (the nearest the input: used by every output). It is what step() and synchronize() check:
        more than backward_passes_per_step passes of it is an error, and none means no backward since the last
        synchronize(). Buckets of one parameter (every large one) count exactly as before. The first step counts
        on the parameters' gradient accumulators instead of the parameters (see install_hooks): torch keeps calling
        a parameter's removed hooks, another ~0.6 us per parameter per backward pass."""
        if self.reducer.overlap or self.counted is not None:
            return
        self.counted = {bucket.name: bucket.arrivals[-1] for bucket in self.reducer.buckets
                        if bucket.arrivals and len(bucket.members) > 1}
        if self.counted:
            self.install_hooks()

    # ------------------------------------------------------------ communication

    def _launch(self, bucket, sync):
        return self.submit(bucket, sync)     # looked up per call: profilers and tests may wrap submit

    def submit(self, bucket, sync):
        """Start (sync=False) or run on this thread (sync=True) the allreduce of one bucket; wait() finishes it."""
        reducer = self.reducer
        if _grads_are_views(bucket):
            # the steady state: backward accumulated straight into the bucket's buffer, nothing to pack
            grads, sparse, flat = bucket.views, [], bucket.buffer
        else:
            grads, sparse = self._dense_grads(bucket)
            flat = None
            if grads and not sparse and self.refilled(bucket) and self._reduce_into_buffer(bucket, grads, sync):
                return
            if bucket.flat and grads and (len(grads) > 1 or not sparse):
                # one copy into the persistent buffer, and .grad becomes views of it (DDP's gradient_as_bucket_view)
                # so later steps accumulate there; a bucket with sparse gradients this step: a one-off flat tensor
                flat = self._into_buffer(bucket, grads) if not sparse else _flatten_dense_tensors(grads)
        # sparse gradients travel as Horovod's do: allgather of indices and values (or dense, sparse_as_dense=True)
        for i, p in enumerate(sparse):
            reducer.track(bucket, functions.sparse_allreduce_async(p.grad, f"{bucket.name}.sparse{i}",
                                                                   reducer.scaling.op, reducer.process_set),
                          functools.partial(setattr, p, "grad"))
        if flat is not None:
            # the bucket travels as ONE flat tensor: one array for the engine, no per-tensor work below this line
            wire, ctx = reducer.compress(flat)
            done = None
            if wire is not flat or flat is not bucket.buffer:
                done = functools.partial(self._unpack_flat, reducer, flat, grads, wire, ctx, bucket.buffer)
            reducer.submit(bucket, [self._buffer_array(bucket) if wire is bucket.buffer else to_array(wire)],
                           sync=sync, done=done)
        elif grads:
            compressed = [reducer.compress(g) for g in grads]
            works = [contiguous(wire) for wire, _ in compressed]
            reducer.submit(bucket, [to_array(w) for w in works], sync=sync,
                           done=functools.partial(self._unpack_each, reducer, grads, compressed, works))

    def _reduce_into_buffer(self, bucket, grads, sync):
        """A refilled bucket of fresh gradients: reduced from where they lie straight into the bucket's buffer,
        whose views become their .grad -- one gradient as one allreduce, several as one grouped allreduce that the
        shm transport reads where they lie. Either way only the part peers read is copied in: on shm half a copy
        less than packing them into the bucket first. False, having done nothing, where a gradient cannot be read
        as it lies (compressed on the wire, not contiguous)."""
        reducer = self.reducer
        for grad in grads:
            wire, _ = reducer.compress(grad)
            if wire is not grad or not grad.is_contiguous():
                return False
        self._buffer_for(bucket, grads)
        views = bucket.views
        for p, view in zip(bucket.keys, views):
            p.grad = view
        # `grads` stays referenced by this frame until the (synchronous) reduction has read them
        reducer.submit(bucket, [to_array(g) for g in grads], outs=[to_array(v) for v in views], sync=sync)
        return True

    @staticmethod
    @torch.no_grad()
    def _unpack_flat(reducer, flat, grads, wire, ctx, buffer, _result):
        if wire is not flat:
            flat.copy_(reducer.decompress(wire, ctx))
        if flat is not buffer:   # a one-off flat tensor
            torch._foreach_copy_(grads, _unflatten_dense_tensors(flat, grads))

    @staticmethod
    @torch.no_grad()
    def _unpack_each(reducer, grads, compressed, works, _result):
        for grad, (wire, ctx), work in zip(grads, compressed, works):
            copy_back(wire, work)
            if wire is not grad:
                grad.copy_(reducer.decompress(wire, ctx))

    def _dense_grads(self, bucket):
        """(dense gradients, parameters with sparse ones) of a bucket, zeros for a parameter without a gradient."""
        grads, sparse = [], []
        for p in bucket.keys:
            if p.grad is None:     # no gradient this step: zeros keep every rank's bucket identical
                p.grad = torch.zeros_like(p)
            if p.grad.is_sparse:   # nn.Embedding(sparse=True)
                if not self.sparse_as_dense:
                    sparse.append(p)
                    continue
                p.grad = p.grad.to_dense()
            grads.append(p.grad)
        return grads, sparse

    def _buffer_array(self, bucket):
        """The numpy array of a bucket's buffer, the same object every step: the shm transport then knows it by
        identity (see SharedMemoryTransport._offset_in_region), and no new array is made per step."""
        buffer, array = self._arrays.get(bucket.name, (None, None))
        if buffer is not bucket.buffer:
            buffer, array = self._arrays[bucket.name] = (bucket.buffer, to_array(bucket.buffer))
        return array

    @staticmethod
    def _buffer_for(bucket, grads):
        """The bucket's persistent flat buffer (and its views shaped like the gradients), made at first use."""
        if bucket.buffer is None:
            numel, like = sum(g.numel() for g in grads), grads[0]
            # on the CPU in the shm window when there is one: reduced where it lies, no copy-in or copy-out
            bucket.buffer = (shared.empty_shared(numel, dtype=like.dtype) if like.device.type == "cpu"
                             else torch.empty(numel, dtype=like.dtype, device=like.device))
            bucket.views = list(_unflatten_dense_tensors(bucket.buffer, grads))
        return bucket.buffer

    @staticmethod
    def _into_buffer(bucket, grads):
        """Copy the bucket's gradients into its persistent flat buffer and make each .grad a view of it."""
        buffer = GradientHooks._buffer_for(bucket, grads)
        with torch.no_grad():
            torch._foreach_copy_(bucket.views, grads)
        for p, view in zip(bucket.keys, bucket.views):
            p.grad = view
        return buffer

    # ------------------------------------------------------------ the step

    def synchronize(self):
        """Wait until every gradient has been allreduced (reducing what backward did not submit). Idempotent until
        the next backward. The Reducer runs the step's end; this binding only re-hooks once the order is known."""
        reducer = self.reducer
        with torch.no_grad():
            # after backward in reverse bucket order: buckets fill in expected ready order, so the last holds the
            # gradients backward wrote last, the likeliest still in the cache
            reducer.finalize(last_ready_first=not reducer.overlap, after_wait=self._after_first_wait)

    def _after_first_wait(self, order_learned):
        if order_learned:
            self.install_hooks()
        self.hook_one_parameter_per_bucket()

    def zero_grad(self, set_to_none):
        """Returns the parameters whose gradients torch's own zero_grad should clear (None: all of them)."""
        reducer = self.reducer
        reducer.check_zero_grad()   # nothing in flight: the unreduced gradients and their pass count go
        # Gradients that are views of a bucket's buffer stay views, zeroed (as DDP's gradient_as_bucket_view): set to
        # None, the next backward would allocate fresh ones and step() would copy them back in -- which is what a
        # refilled bucket (large gradients, after backward) does on purpose. From step() on it makes no difference:
        # every trainable parameter then has a gradient (zeros if no rank used it).
        if all(bucket.views is None for bucket in reducer.buckets):
            return None
        others = self._unbucketed_params()
        for bucket in reducer.buckets:
            if bucket.views is None or (set_to_none and self.refilled(bucket)):
                others += bucket.keys
                continue
            bucket.buffer.zero_()
            if not _grads_are_views(bucket):
                others += [p for p, view in zip(bucket.keys, bucket.views) if p.grad is not view]
        return others

    def _unbucketed_params(self):
        """A new list of the parameters in no bucket: frozen at construction (a parameter unfrozen later still has
        torch's semantics). Looked up again only when param_groups change (add_param_group, a new params list):
        walking 400 parameters costs ~50 us of a step."""
        groups = self.optimizer.param_groups
        seen, unbucketed = self._unbucketed
        if len(seen) != len(groups) or any(params is not g["params"] or n != len(params)
                                           for (params, n), g in zip(seen, groups)):
            seen = [(g["params"], len(g["params"])) for g in groups]
            unbucketed = self.reducer.unbucketed(self.all_params())
            self._unbucketed = (seen, unbucketed)
        return list(unbucketed)

    def refilled(self, bucket):
        """True for a host bucket of large gradients reduced after backward: zero_grad(set_to_none=True) drops
        them and the next submission copies them in; False: they stay views of the bucket's buffer (see
        _REFILL_MIN_TENSOR_BYTES)."""
        choice = self._refilled.get(bucket.name)
        if choice is None:
            members = bucket.members
            choice = self._refilled[bucket.name] = (
                not self.reducer.overlap and bucket.flat and all(m.host for m in members)
                and sum(m.nbytes for m in members) >= self.refill_min_tensor_bytes * len(members))
        return choice

    def drop_pending(self):
        """Wait for gradients in flight and drop pending accumulation: the next backward starts a fresh step."""
        with torch.no_grad():
            self.reducer.drop_pending()


@torch.no_grad()
def clear_gradients(params, set_to_none):
    """torch.optim.Optimizer.zero_grad's rule for these parameters' gradients."""
    for p in params:
        if p.grad is None:
            continue
        if set_to_none:
            p.grad = None
        else:
            p.grad.detach_()
            p.grad.zero_()


