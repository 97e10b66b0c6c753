"""Sharded data parallelism (ZeRO stages 1 and 2): each rank keeps the optimizer state of 1/N of the parameters.

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), shard="gradients")

Why a keyword of DistributedOptimizer rather than another class: a training script changes one argument, keeps
its lr schedulers (the result is still an instance of the optimizer's own class, with the user's param_groups) and
its Horovod habits (broadcast_parameters, broadcast_optimizer_state, backward_passes_per_step, compression,
process sets). What changes is visible in the name of the option: what is sharded.

- shard="optimizer" (stage 1): gradients are averaged over the ranks as without sharding, and every rank keeps
  them whole in .grad; each rank keeps optimizer state (Adam's two moments) for its shard only, steps only its
  shard, then the ranks allgather the updated parameters.
- shard="gradients" (stage 2): each gradient bucket is reduce-scattered instead of allreduced, as soon as its
  last gradient is final (during backward), and its full gradients are freed: a rank keeps only its shard of the
  averaged gradients as well. After backward, parameters' .grad are None; use `optimizer.clip_grad_norm_`.

The plan of who owns what is ringtrain.reducer.sharding.ShardPlan: buckets of parameters (in backward order) cut into N
blocks that differ by at most one element, the core reducescatter's own split; a parameter may be cut anywhere.
The wrapped optimizer's algorithm runs unchanged on 1-D views of the parameters' own memory (no copy of the
parameters is kept), so any torch.optim optimizer whose update is elementwise works (SGD, Adam, AdamW, Adagrad,
RMSprop, NAdam, RAdam, Adamax, Adadelta, Rprop, ASGD). Optimizers that need a parameter's shape or all parameters
at once (Adafactor, LBFGS, SparseAdam, Muon) are refused. Where the user left the implementation to torch (foreach
and fused None), the shard is stepped with torch's fused kernel on the CPU when the class has one (SGD, Adam, AdamW,
Adagrad), else with foreach: the same update, in one pass over memory instead of one per operation.

Checkpoints: `consolidate_state_dict(to=0)` on every rank, then `state_dict()` on rank `to` gives the optimizer's
ordinary torch state dict (as the unsharded optimizer would have it), loadable at any number of ranks with
`load_state_dict()` (every rank passes the full dict; each keeps its slices) or by a plain torch optimizer.
`save_shards(path)` / `load_shards(path)` write and read one file per rank instead (no rank holds the whole
state), and reshard on load as well. hvd.save_checkpoint / hvd.load_checkpoint consolidate and scatter by
themselves.

Parameter allgather: by default step() ends when every parameter is updated on every rank (two buckets in flight, so
it costs two buckets of memory; a bucket of one parameter is gathered into the parameter itself, no memory).
gather_parameters="forward" lets step() return at once: the allgathers run while the next batch is prepared and the
forward pass runs, and each module's forward waits only for its own parameters (a global forward pre-hook).
Parameters read outside their module's forward (tied weights used by another module, saving the model by hand) need
`optimizer.wait_for_parameters()` first; hvd.save_checkpoint waits.

Uneven inputs: a rank out of data calls `optimizer.join()` (not hvd.join()): it keeps taking part in the other
ranks' steps with zero gradients -- it still owns a shard to update and allgather -- until every rank has joined.
The step then uses sum(gradients of ranks with data) / size, as DistributedOptimizer's join does.
"""
import collections
import contextlib
import functools
import os
import warnings

import torch

from ringtrain import host_memory
from ringtrain.errors import RingtrainError, TensorMismatchError
from ringtrain.reducer.model_check import describe_model_mismatch
from ringtrain.core import state as core_state
from ringtrain.core.process_sets import global_process_set
from ringtrain.reducer.reducer import Collective, Reducer, Scaling, instance_prefix, plan_buckets
from ringtrain.reducer.sharding import ShardPlan
from ringtrain.reducer.wrapping import adopt, wrapper_class

from . import functions
from .compression import Compression
from .functions import Average, Sum, as_op, contiguous, from_array, to_array
from .sharded_checkpoint import ShardCheckpoint
from .sharded_update import ParameterGather, ShardUpdate
from .gradient_hooks import (_ALONE_BYTES, GradientHooks, _name_parameters, clear_gradients, default_overlap,
                             parameter_members)

STAGES = {"optimizer": 1, "gradients": 2}
_MB = 1 << 20
# optimizers whose update is not elementwise: a shard of a parameter would change their result
_REFUSED = ("Adafactor", "LBFGS", "SparseAdam", "Muon")


class ShardedOptimizerMixin:
    """Mixed in front of the wrapped optimizer's own class by DistributedOptimizer(..., shard=...). All binding
    state lives in `self._ringtrain` (a _Sharding); param_groups are the user's, the wrapped optimizer's own
    state stays empty (the shard's state lives in an inner optimizer of the same class over the shard's views)."""

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("a sharded optimizer's step() takes no closure: run forward and backward, then step()")
        return self._ringtrain.step()

    def synchronize(self):
        """Wait until every gradient bucket has been reduced (reducing the buckets backward did not submit)."""
        self._ringtrain.synchronize()

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Horovod's name; step() never reduces twice after synchronize() or clip_grad_norm_() anyway."""
        yield

    def clip_grad_norm_(self, max_norm, norm_type=2.0):
        """torch.nn.utils.clip_grad_norm_ over the whole model, from the shards: each rank sums |g|^p over its shard
        of the averaged gradients, one allreduce adds the ranks' sums. Call it after backward, before step().
        Returns the total norm (the same on every rank)."""
        return self._ringtrain.clip_grad_norm_(float(max_norm), float(norm_type))

    def zero_grad(self, set_to_none=True):
        self._ringtrain.zero_grad(set_to_none)

    def join(self):
        """This rank has no more data: take part in the other ranks' steps with zero gradients until every rank
        has joined. Returns the last rank to join. Every rank calls it once, after its last step()."""
        return self._ringtrain.join()

    def consolidate_state_dict(self, to=0):
        """Collective: gather the whole optimizer state on world rank `to` for its state_dict()."""
        self._ringtrain.checkpoint.consolidate(to)

    def state_dict(self):
        """On the rank given to consolidate_state_dict(): the unsharded optimizer's state dict."""
        return self._ringtrain.checkpoint.consolidated_state_dict()

    def load_state_dict(self, state_dict):
        """Every rank passes the same full state dict (from state_dict() or from an unsharded torch optimizer of
        the same model); each keeps its own slices. Works at any number of ranks."""
        self._ringtrain.checkpoint.load_full(state_dict)

    def scatter_state_dict(self, state_dict, root_rank=0):
        """Collective: world rank root_rank's full state dict (None on the other ranks) loaded on every rank, one
        bucket at a time (hvd.load_checkpoint uses it)."""
        self._ringtrain.checkpoint.scatter_from(state_dict, root_rank)

    def save_shards(self, path):
        """Collective: each rank writes its shard to `<path>.shard<rank>`, rank 0 the layout to `path`, atomically."""
        self._ringtrain.checkpoint.save_shards(os.fspath(path))

    def load_shards(self, path):
        """Collective: read the files save_shards(path) wrote, at any number of ranks then and now. Every rank must
        see the files (a shared file system)."""
        self._ringtrain.checkpoint.load_shards(os.fspath(path))

    def wait_for_parameters(self):
        """With gather_parameters="forward": finish every parameter allgather still in flight, e.g. before reading
        or saving the model's parameters outside its forward. A no-op otherwise."""
        self._ringtrain.gather.wait()

    def shard_numel(self):
        """Number of parameter elements this rank updates (and keeps optimizer state for)."""
        return self._ringtrain.plan.owned_numel(self._ringtrain.rank)

    def add_param_group(self, param_group):
        raise RingtrainError("a sharded optimizer's parameters are fixed when it is wrapped: add the parameter "
                             "group to the torch optimizer before DistributedOptimizer(..., shard=...)")


class _Sharding:
    """The sharded step: the plan, and in order its parts -- the gradients (reduced by a Reducer), the update of
    this rank's shard, the parameter allgather -- plus what spans them (the model check, clipping, zero_grad,
    join). The checkpoint I/O is ShardCheckpoint's. Lives beside the user's optimizer (as DDP's Reducer), as its
    one attribute `_ringtrain`."""

    def __init__(self, owner, named_parameters, stage, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, process_set, bucket_cap_mb, first_bucket_mb, overlap,
                 gather_parameters):
        base = type(owner).__mro__[2]            # (wrapper class, ShardedOptimizerMixin, the user's class, ...)
        if base.__name__ in _REFUSED:
            raise ValueError(f"{base.__name__} does not update each element independently of the others, so it "
                             "cannot step a shard of a parameter; use DistributedOptimizer without shard=")
        op = as_op(op)
        if op not in (Average, Sum):
            raise ValueError(f"a sharded optimizer reduces gradients with op=Average or Sum, got {op.name}")
        scaling = Scaling.for_gradients(op, gradient_predivide_factor)
        if int(backward_passes_per_step) < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        if overlap not in (None, True, False):
            raise ValueError(f"overlap must be None, True or False, got {overlap!r}")
        if gather_parameters not in ("step", "forward"):
            raise ValueError(f"gather_parameters must be 'step' or 'forward', got {gather_parameters!r}")
        self.owner, self.stage = owner, stage
        self.process_set = process_set
        self.size = functions.size() if process_set.process_set_id == 0 else process_set.size()
        self.rank = process_set.rank()
        self.prefix = instance_prefix("ShardedOptimizer", process_set)

        all_params = [p for group in owner.param_groups for p in group["params"]]
        self.index_of = {id(p): i for i, p in enumerate(all_params)}      # torch's numbering in state dicts
        self.names = _name_parameters(all_params, named_parameters)
        self.params = [p for p in all_params if p.requires_grad]
        for p in self.params:
            if not p.is_contiguous():
                raise ValueError(f"parameter {self.names[id(p)]!r} is not contiguous; a shard is a view of it")
        if overlap is None:
            # stage 2 frees each bucket's gradients as it is reduced: that needs the reduction during backward
            overlap = True if stage == 2 else default_overlap(self.params, functions.local_size())
        if not core_state.config().elastic:
            # a collective: not in an elastic job, where a worker that joins builds its optimizer while the others
            # train (as DistributedOptimizer's GradientHooks)
            overlap = self._check_same_model(all_params, overlap)
        # what a new world's plan needs again (ringtrain/torch/elastic_shards.py)
        self.settings = dict(scaling=scaling, compression=compression, passes=backward_passes_per_step,
                             overlap=overlap, in_forward=gather_parameters == "forward")

        # the reducer's bucket rule, in backward order (last layers' gradients are final first); a large parameter
        # alone is reduced and gathered in place
        self.position = {id(p): i for i, p in enumerate(self.params)}
        members = parameter_members(self.params, self.names)
        layout = plan_buckets(list(reversed(members)), int(first_bucket_mb * _MB), int(bucket_cap_mb * _MB),
                              alone_bytes=_ALONE_BYTES)
        self.plan = ShardPlan([p.numel() for p in self.params],
                              [[self.position[id(m.key)] for m in bucket] for bucket in layout], self.size)
        self.bucket_of = self.plan.bucket_of
        self.pieces = self.plan.pieces(self.rank)
        self.update = ShardUpdate(base, owner, self.params, self.pieces)
        self.gather = ParameterGather(self.params, self.plan, self.pieces, self.update.views, self.prefix,
                                      process_set, in_forward=gather_parameters == "forward")

        if stage == 1:      # gradients allreduced exactly as DistributedOptimizer's (its buckets, views, schedules)
            self.gradients = _ReplicatedGradients(owner, named_parameters, compression, backward_passes_per_step,
                                                  op, gradient_predivide_factor, bucket_cap_mb, first_bucket_mb,
                                                  process_set, overlap)
        else:               # the reducer's reducescatter buckets, laid out as the plan's
            self.gradients = _ScatteredGradients(self.params, self.names, self.plan, self.rank, self.prefix,
                                                 scaling, compression, process_set, backward_passes_per_step,
                                                 overlap)
        self.checkpoint = ShardCheckpoint(self)

    def _check_same_model(self, all_params, overlap):
        mine = [(self.names[id(p)], tuple(p.shape), str(p.dtype).replace("torch.", ""), p.requires_grad)
                for p in all_params]
        everyone = functions.allgather_object((mine, bool(overlap), self.stage), name=self.prefix + ".model_check",
                                              process_set=self.process_set)
        models = [entries for entries, _, _ in everyone]
        if any(entries != models[0] for entries in models):
            raise TensorMismatchError(describe_model_mismatch(
                models, "DistributedOptimizer(shard=...)", "parameter",
                lambda spec: f"shape {spec[0]} {spec[1]} requires_grad={spec[2]}",
                "Every rank must build the same model and pass its parameters in the same order."))
        stages = sorted({stage for _, _, stage in everyone})
        if len(stages) > 1:
            raise ValueError(f"ranks asked for different shard= stages {stages}; every rank must shard the same way")
        return all(choice for _, choice, _ in everyone)

    # ------------------------------------------------------------ gradients

    def synchronize(self):
        """Reduce every gradient bucket (those backward did not submit too), then point each piece's .grad at its
        slice of the averaged gradient."""
        if not self.gradients.synchronize():
            return
        with torch.no_grad():
            for piece, view in zip(self.pieces, self.update.views):
                view.grad = self.gradients.piece_gradient(piece, self.params[piece.param])

    # ------------------------------------------------------------ the step

    def step(self):
        self._active_count(active=True)
        self.synchronize()
        return self._apply()

    def _apply(self):
        self.gather.wait()                   # (gathers still in flight from the last step: an unused layer's)
        result = self.update.step()
        self.gradients.prepare_for_backward()
        self.gather.after_step()
        return result

    def clip_grad_norm_(self, max_norm, norm_type):
        self.synchronize()
        grads = [v.grad for v in self.update.views if v.grad is not None]
        like = self.params[0]
        if norm_type == float("inf"):
            local = max((g.abs().max() for g in grads if g.numel()), default=torch.zeros((), dtype=like.dtype))
            op = functions.Max
        else:
            local = sum((g.abs().pow(norm_type).sum() for g in grads), torch.zeros((), dtype=like.dtype))
            op = Sum
        total = local.reshape(1).to(torch.float64)
        functions.allreduce_(total, name=f"{self.prefix}.grad_norm", op=op, process_set=self.process_set)
        total = total[0] if norm_type == float("inf") else total[0] ** (1.0 / norm_type)
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        with torch.no_grad():
            if self.stage == 1:      # every rank holds the whole gradient: scale it all, the shards are views of it
                grads = [p.grad for p in self.params if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, coefficient.to(grads[0].dtype))
        return total.to(like.dtype)

    def zero_grad(self, set_to_none):
        others = self.gradients.zero_grad(set_to_none)
        for view in self.update.views:
            view.grad = None
        clear_gradients(self.params if others is None else others, set_to_none)

    # ------------------------------------------------------------ uneven inputs

    def _active_count(self, active):
        """One small allreduce per step: which ranks still have data (a joined rank keeps stepping with zeros)."""
        flags = torch.zeros(self.size, dtype=torch.int32)
        if active:
            flags[self.rank] = 1
        functions.allreduce_(flags, name=f"{self.prefix}.active", op=Sum, process_set=self.process_set)
        return flags

    def join(self):
        self.gather.wait()
        last = self.rank
        self.zero_grad(set_to_none=True)
        while True:
            flags = self._active_count(active=False)
            if not flags.any():
                return last
            last = int(flags.nonzero()[-1])
            self.zero_grad(set_to_none=True)
            self.synchronize()                 # every bucket, with zeros from this rank
            self._apply()












class _ReplicatedGradients:
    """Stage 1: the gradients reduced by DistributedOptimizer's own GradientHooks (allreduce buckets, .grad views of
    them, either schedule); a piece's gradient is a view of its parameter's averaged .grad."""

    def __init__(self, owner, named_parameters, compression, backward_passes_per_step, op, gradient_predivide_factor,
                 bucket_cap_mb, first_bucket_mb, process_set, overlap):
        self.hooks = GradientHooks(owner, named_parameters, compression, backward_passes_per_step, op,
                                   gradient_predivide_factor, bucket_cap_mb, first_bucket_mb, None, True,
                                   process_set, overlap)
        self.reducer = self.hooks.reducer

    def synchronize(self):
        """True when it reduced something (False: already synchronized)."""
        if self.reducer.is_synchronized():
            return False
        self.hooks.synchronize()
        return True

    @staticmethod
    def piece_gradient(piece, param):
        # a view of the parameter's own .grad, so clipping or inspecting .grad sees the same numbers
        return param.grad.view(-1)[piece.start:piece.start + piece.length]

    def prepare_for_backward(self):
        self.reducer.prepare_for_backward()

    def zero_grad(self, set_to_none):
        return self.hooks.zero_grad(set_to_none)

    def drop_pending(self):
        self.hooks.drop_pending()


class _ScatteredGradients:
    """Stage 2: a Reducer of reducescatter buckets laid out as the shard plan's (user groups: never re-laid). A
    bucket of one parameter travels in its own .grad; several are packed into a flat tensor; either way the full
    gradients are dropped once submitted, and only this rank's shard of each bucket is kept. The hooks and the
    handover are this class's; the step's lifecycle is the Reducer's."""

    def __init__(self, params, names, plan, rank, prefix, scaling, compression, process_set, passes_per_step,
                 overlap):
        self.params, self.plan, self.rank = params, plan, rank
        self.reducer = Reducer(parameter_members(params, names), prefix=prefix, scaling=scaling,
                               compression=compression, process_set=process_set, passes_per_step=passes_per_step,
                               overlap=overlap, groups=[[params[i] for i in b.params] for b in plan.buckets],
                               collective=Collective.REDUCESCATTER, launch=self._submit)
        self.shards = {}                 # bucket index -> this rank's block of the averaged bucket (1-D)
        host = [m.nbytes for m in self.reducer.members if m.host]
        if host:
            # every step backward makes each full gradient afresh and it is freed once reduce-scattered: keep the
            # freed blocks in the heap for the next step instead of faulting in fresh pages (as GradientHooks does)
            host_memory.keep_freed_blocks(max(host), sum(host))
        self.hooks = [p.register_post_accumulate_grad_hook(self.reducer.gradient_ready) for p in params]

    def _submit(self, bucket, sync):
        params = bucket.keys
        with torch.no_grad():
            if len(params) == 1 and params[0].grad is not None and params[0].grad.is_contiguous():
                flat = params[0].grad.view(-1)              # no copy: reduced where backward left it
            else:
                like = params[0]
                flat = torch.empty(sum(p.numel() for p in params), dtype=like.dtype, device=like.device)
                for p, start in zip(params, self.plan.buckets[bucket.index].starts):
                    target = flat[start:start + p.numel()]
                    if p.grad is None:      # no gradient this step: zeros keep every rank's bucket identical
                        target.zero_()
                    else:
                        target.copy_(p.grad.reshape(-1))
            for p in params:
                p.grad = None               # the point of stage 2: only the shard of this bucket stays
        wire, ctx = self.reducer.compress(flat)
        # the request alone holds the full bucket now: it is freed as soon as the reducescatter has run
        self.reducer.submit(bucket, [to_array(contiguous(wire))], sync=sync,
                            done=functools.partial(self._keep_shard, bucket.index, ctx))

    def _keep_shard(self, index, ctx, result):
        self.shards[index] = self.reducer.decompress(from_array(result), ctx).reshape(-1)

    def synchronize(self):
        """True when it reduced something (False: already synchronized)."""
        with torch.no_grad():
            return self.reducer.finalize()      # (the plan's buckets stay: only the phase moves on)

    def piece_gradient(self, piece, param):
        lo = piece.offset - self.plan.buckets[piece.bucket].block_starts[self.rank]
        return self.shards[piece.bucket][lo:lo + piece.length]

    def prepare_for_backward(self):
        self.shards = {}
        self.reducer.prepare_for_backward()

    def zero_grad(self, set_to_none):
        self.reducer.check_zero_grad()
        self.shards = {}
        return None

    def drop_pending(self):
        with torch.no_grad():
            self.reducer.drop_pending()
        self.shards = {}


def sharded_optimizer(optimizer, shard, named_parameters=None, compression=Compression.none,
                      backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                      process_set=global_process_set, bucket_cap_mb=25, first_bucket_mb=1.0, overlap=None,
                      gather_parameters="step"):
    """What DistributedOptimizer(optimizer, shard=...) returns; see the module docstring."""
    if shard not in STAGES:
        raise ValueError(f"shard must be one of {sorted(STAGES)} (or None for no sharding), got {shard!r}")
    if named_parameters is not None:
        named_parameters = list(named_parameters)      # (read twice at stage 1: here and by GradientHooks)
    # the same param_groups, defaults and hooks: the wrapper IS the user's optimizer
    wrapped = adopt(wrapper_class(ShardedOptimizerMixin, optimizer.__class__), optimizer)
    if any(float(entry.get("step", 0)) for entry in wrapped.state.values()):   # (Adagrad's starts at step 0)
        warnings.warn("the optimizer already has state; it is dropped when sharding (load it afterwards with "
                      "load_state_dict)", stacklevel=3)
    wrapped.state = collections.defaultdict(dict)
    wrapped._ringtrain = _Sharding(wrapped, named_parameters, STAGES[shard], compression, backward_passes_per_step,
                                     op, gradient_predivide_factor, process_set, bucket_cap_mb, first_bucket_mb,
                                     overlap, gather_parameters)
    return wrapped

