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
import inspect
import os
import warnings
import weakref

import torch

from ringtrain import host_memory
from ringtrain.errors import RingtrainError, TensorMismatchError
from ringtrain.reducer.model_check import describe_model_mismatch
from ringtrain.core.process_sets import global_process_set
from ringtrain.reducer.reducer import Collective, Reducer, Scaling, instance_prefix, plan_buckets
from ringtrain.reducer.sharding import ShardPlan, overlaps
from ringtrain.reducer.wrapping import adopt, wrapper_class

from . import functions, shared
from .checkpoint import _write_atomically as write_atomically
from .compression import Compression
from .functions import Average, Sum, as_op, contiguous, from_array, to_array
from .gradient_hooks import (_ALONE_BYTES, GradientHooks, _name_parameters, clear_gradients, default_overlap,
                             parameter_members)

STAGES = {"optimizer": 1, "gradients": 2}
_MB = 1 << 20
# optimizers whose update is not elementwise: a shard of a parameter would change their result
_REFUSED = ("Adafactor", "LBFGS", "SparseAdam", "Muon")
# the keywords that choose how torch runs an optimizer's update, not what it computes
_IMPLEMENTATION_KEYS = ("foreach", "fused")


class ShardedOptimizerMixin:
    """Mixed in front of the wrapped optimizer's own class by DistributedOptimizer(..., shard=...). All binding
    state lives in `self._rt_sharding` (a _Sharding); param_groups are the user's, the wrapped optimizer's own
    state stays empty (the shard's state lives in an inner optimizer of the same class over the shard's views)."""

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("a sharded optimizer's step() takes no closure: run forward and backward, then step()")
        return self._rt_sharding.step()

    def synchronize(self):
        """Wait until every gradient bucket has been reduced (reducing the buckets backward did not submit)."""
        self._rt_sharding.synchronize()

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Horovod's name; step() never reduces twice after synchronize() or clip_grad_norm_() anyway."""
        yield

    def clip_grad_norm_(self, max_norm, norm_type=2.0):
        """torch.nn.utils.clip_grad_norm_ over the whole model, from the shards: each rank sums |g|^p over its shard
        of the averaged gradients, one allreduce adds the ranks' sums. Call it after backward, before step().
        Returns the total norm (the same on every rank)."""
        return self._rt_sharding.clip_grad_norm_(float(max_norm), float(norm_type))

    def zero_grad(self, set_to_none=True):
        self._rt_sharding.zero_grad(set_to_none)

    def join(self):
        """This rank has no more data: take part in the other ranks' steps with zero gradients until every rank
        has joined. Returns the last rank to join. Every rank calls it once, after its last step()."""
        return self._rt_sharding.join()

    def consolidate_state_dict(self, to=0):
        """Collective: gather the whole optimizer state on world rank `to` for its state_dict()."""
        self._rt_sharding.consolidate(to)

    def state_dict(self):
        """On the rank given to consolidate_state_dict(): the unsharded optimizer's state dict."""
        return self._rt_sharding.consolidated_state_dict()

    def load_state_dict(self, state_dict):
        """Every rank passes the same full state dict (from state_dict() or from an unsharded torch optimizer of
        the same model); each keeps its own slices. Works at any number of ranks."""
        self._rt_sharding.load_full(state_dict)

    def scatter_state_dict(self, state_dict, root_rank=0):
        """Collective: world rank root_rank's full state dict (None on the other ranks) loaded on every rank, one
        bucket at a time (hvd.load_checkpoint uses it)."""
        self._rt_sharding.scatter_from(state_dict, root_rank)

    def save_shards(self, path):
        """Collective: each rank writes its shard to `<path>.shard<rank>`, rank 0 the layout to `path`, atomically."""
        self._rt_sharding.save_shards(os.fspath(path))

    def load_shards(self, path):
        """Collective: read the files save_shards(path) wrote, at any number of ranks then and now. Every rank must
        see the files (a shared file system)."""
        self._rt_sharding.load_shards(os.fspath(path))

    def wait_for_parameters(self):
        """With gather_parameters="forward": finish every parameter allgather still in flight, e.g. before reading
        or saving the model's parameters outside its forward. A no-op otherwise."""
        self._rt_sharding.wait_for_parameters()

    def shard_numel(self):
        """Number of parameter elements this rank updates (and keeps optimizer state for)."""
        return self._rt_sharding.plan.owned_numel(self._rt_sharding.rank)

    def add_param_group(self, param_group):
        raise RingtrainError("a sharded optimizer's parameters are fixed when it is wrapped: add the parameter "
                             "group to the torch optimizer before DistributedOptimizer(..., shard=...)")


class _Sharding:
    """The sharded optimizer's own state: the plan, the gradient buckets in flight, the inner optimizer over this
    rank's shard. Lives beside the user's optimizer (as DDP's Reducer), not in its attributes."""

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
        self.gather_in_forward = gather_parameters == "forward"
        self.gathers = {}                                  # bucket -> allgather handle not yet unpacked
        if self.gather_in_forward:
            _install_forward_hook()
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
        overlap = self._check_same_model(all_params, overlap)

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
        self._build_inner(base)

        if stage == 1:      # gradients allreduced exactly as DistributedOptimizer's (its buckets, views, schedules)
            self.gradients = _ReplicatedGradients(owner, named_parameters, compression, backward_passes_per_step,
                                                  op, gradient_predivide_factor, bucket_cap_mb, first_bucket_mb,
                                                  process_set, overlap)
        else:               # the reducer's reducescatter buckets, laid out as the plan's
            self.gradients = _ScatteredGradients(self.params, self.names, self.plan, self.rank, self.prefix,
                                                 scaling, compression, process_set, backward_passes_per_step,
                                                 overlap)
        self.consolidated = None

    def _build_inner(self, base):
        """The user's optimizer class over this rank's pieces: 1-D views of the parameters' memory, grouped as the
        user's param_groups (so each piece keeps its group's lr, weight decay, ...)."""
        group_of = {}
        for g, group in enumerate(self.owner.param_groups):
            for p in group["params"]:
                group_of[id(p)] = g
        self.views = []
        members = [[] for _ in self.owner.param_groups]
        for piece in self.pieces:
            p = self.params[piece.param]
            view = p.detach().view(-1)[piece.start:piece.start + piece.length]
            self.views.append(view)
            members[group_of[id(p)]].append(view)
        # the constructor's own keywords only (AdamW's defaults hold a decoupled_weight_decay it does not take)
        accepted = inspect.signature(base.__init__).parameters
        self.implementation = _implementation(accepted, self.owner.param_groups, self.views)
        groups = [dict(self._settings(group), params=params)
                  for group, params in zip(self.owner.param_groups, members)]
        keywords = {k: v for k, v in self.owner.defaults.items() if k in accepted}
        self.inner = base(groups, **dict(keywords, **self.implementation))
        self.inner_index = {id(v): i for i, v in enumerate(v for g in groups for v in g["params"])}

    def _settings(self, group):
        """What the inner optimizer's group for the user's `group` holds besides its views: the user's settings, and
        the implementation chosen for the shard (torch's load_state_dict replaces whole groups: it must come too)."""
        return dict(_hyperparameters(group), **self.implementation)

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
        if self.gradients.is_synchronized():
            return
        self.gradients.synchronize()
        with torch.no_grad():
            for piece, view in zip(self.pieces, self.views):
                view.grad = self.gradients.piece_gradient(piece, self.params[piece.param])

    # ------------------------------------------------------------ the step

    def step(self):
        self._active_count(active=True)
        self.synchronize()
        return self._apply()

    def _apply(self):
        self.wait_for_parameters()           # (gathers still in flight from the last step: an unused layer's)
        for group, mine in zip(self.owner.param_groups, self.inner.param_groups):
            mine.update(self._settings(group))        # lr schedulers change the user's groups
        result = self.inner.step()
        self.gradients.reopen()
        for view in self.views:
            view.grad = None
        if self.gather_in_forward:
            self._start_gathers_for_forward()
        else:
            self._allgather_parameters()
        return result

    def _start_gather(self, b):
        """Allgather this rank's updated block of bucket b (its one piece in place, several concatenated). A bucket
        of one parameter is gathered into the parameter itself: this rank's block already lies there, so nothing
        is copied in or out on this side of the transport."""
        pieces = [view for piece, view in zip(self.pieces, self.views) if piece.bucket == b]
        bucket = self.plan.buckets[b]
        like = self.params[bucket.params[0]]
        block = (pieces[0] if len(pieces) == 1 else torch.cat(pieces) if pieces
                 else torch.empty(0, dtype=like.dtype, device=like.device))
        into = like.detach().view(-1) if len(bucket.params) == 1 else None
        return functions.allgather_async(block, name=f"{self.prefix}.param{b}", process_set=self.process_set,
                                         out=into)

    def _allgather_parameters(self):
        """Every rank's updated block of each bucket, concatenated in rank order, is the whole bucket: unpack it into
        the parameters. Two buckets in flight at a time: peak extra memory is two buckets, not the model."""
        in_flight = collections.deque()
        with torch.no_grad():
            for b in range(len(self.plan.buckets)):
                in_flight.append((b, self._start_gather(b)))
                if len(in_flight) > 1:
                    self._unpack(*in_flight.popleft())
            while in_flight:
                self._unpack(*in_flight.popleft())

    def _start_gathers_for_forward(self):
        """gather_parameters="forward": start every bucket's allgather now, first layers first (buckets follow
        backward order), and unpack each when a module that owns one of its parameters starts its forward."""
        for b in reversed(range(len(self.plan.buckets))):
            self.gathers[b] = self._start_gather(b)
        _GATHERING.add(self)

    def before_forward(self, module):
        for p in module._parameters.values():
            b = self.bucket_of[self.position[id(p)]] if p is not None and id(p) in self.position else None
            if b is not None and b in self.gathers:
                with torch.no_grad():
                    self._unpack(b, self.gathers.pop(b))
        if not self.gathers:
            _GATHERING.discard(self)

    def wait_for_parameters(self):
        """Unpack every parameter allgather still in flight (gather_parameters="forward")."""
        with torch.no_grad():
            for b in sorted(self.gathers, reverse=True):
                self._unpack(b, self.gathers.pop(b))
        _GATHERING.discard(self)

    def _unpack(self, b, handle):
        whole = handle.wait()
        bucket = self.plan.buckets[b]
        if len(bucket.params) == 1:           # gathered in place (_start_gather)
            return
        params = [self.params[i] for i in bucket.params]
        torch._foreach_copy_([p.detach().view(-1) for p in params],
                             [whole[s:s + p.numel()] for p, s in zip(params, bucket.starts)])

    def clip_grad_norm_(self, max_norm, norm_type):
        self.synchronize()
        grads = [v.grad for v in self.views if v.grad is not None]
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
        for view in self.views:
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
        self.wait_for_parameters()
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

    # ------------------------------------------------------------ checkpoints

    def _elementwise(self, view, value):
        return isinstance(value, torch.Tensor) and value.dim() == 1 and value.shape == view.shape

    def consolidate(self, to):
        """Gather the whole state on world rank `to`, bucket by bucket: the scalars (step counts, ...) of each
        parameter travel pickled, each elementwise state key as one allgather of the ranks' blocks per bucket."""
        self.wait_for_parameters()
        manifest = {}              # param -> {key: ("tensor", dtype) | ("value", value)}, from its first piece here
        for piece, view in zip(self.pieces, self.views):
            state = self.inner.state.get(view, {})
            if piece.param in manifest or not state:
                continue
            manifest[piece.param] = {key: ("tensor", value.dtype) if self._elementwise(view, value)
                                     else ("value", value) for key, value in state.items()}
        merged = {}
        for part in functions.allgather_object(manifest, name=f"{self.prefix}.manifest",
                                               process_set=self.process_set):
            merged.update(part)
        keep = functions.rank() == to
        state = {}
        by_bucket = collections.defaultdict(list)
        for piece, view in zip(self.pieces, self.views):
            by_bucket[piece.bucket].append((piece, view))
        for b, bucket in enumerate(self.plan.buckets):
            keys = sorted({(key, spec[1]) for i in bucket.params for key, spec in merged.get(i, {}).items()
                           if spec[0] == "tensor"}, key=lambda kd: kd[0])
            for key, dtype in keys:
                parts = []
                for piece, view in by_bucket[b]:
                    value = self.inner.state.get(view, {}).get(key)
                    parts.append(value if value is not None else torch.zeros(piece.length, dtype=dtype))
                block = torch.cat(parts) if parts else torch.empty(0, dtype=dtype)
                whole = functions.allgather_async(block.to(dtype), name=f"{self.prefix}.state{b}.{key}",
                                                  process_set=self.process_set).wait()
                if keep:
                    for i, start in zip(bucket.params, bucket.starts):
                        if key in merged.get(i, {}):
                            p = self.params[i]
                            state.setdefault(i, {})[key] = whole[start:start + p.numel()].view_as(p).clone()
        if keep:
            full = {}
            for i, p in enumerate(self.params):
                if i not in merged:
                    continue
                entry = {key: (state[i][key] if spec[0] == "tensor" else _copy(spec[1]))
                         for key, spec in merged[i].items()}
                full[self.index_of[id(p)]] = entry
            self.consolidated = {"state": full, "param_groups": self._param_groups_for_saving()}
        else:
            self.consolidated = None

    def _param_groups_for_saving(self):
        groups = []
        for group in self.owner.param_groups:
            groups.append(dict(_hyperparameters(group), params=[self.index_of[id(p)] for p in group["params"]]))
        return groups

    def consolidated_state_dict(self):
        if self.consolidated is None:
            raise RingtrainError("a sharded optimizer's state_dict() is the state consolidated on one rank: call "
                                 "optimizer.consolidate_state_dict(to=rank) on every rank first, then state_dict() "
                                 "on that rank (hvd.save_checkpoint does this for you)")
        result, self.consolidated = self.consolidated, None
        return result

    def load_full(self, state_dict):
        """Each piece takes its slice of the full state dict's tensors (shaped like the parameter)."""
        saved = state_dict["state"]
        entries = []
        for piece in self.pieces:
            p = self.params[piece.param]
            entry = {}
            for key, value in saved.get(self.index_of[id(p)], {}).items():
                if _is_elementwise(key, value, p.shape):
                    entry[key] = value.reshape(-1)[piece.start:piece.start + piece.length].clone()
                else:
                    entry[key] = _copy(value)
            entries.append(entry)
        self._load_pieces(entries, state_dict["param_groups"])

    def _load_pieces(self, entries, param_groups):
        """entries[k] = this rank's k-th piece's state ({key: value}); loads them into the inner optimizer and the
        saved hyper-parameters into the user's groups."""
        self.wait_for_parameters()
        if len(param_groups) != len(self.owner.param_groups):
            raise ValueError(f"the state dict has {len(param_groups)} parameter groups, this optimizer "
                             f"{len(self.owner.param_groups)}")
        for group, saved in zip(self.owner.param_groups, param_groups):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(f"a saved parameter group has {len(saved['params'])} parameters, this "
                                 f"optimizer's {len(group['params'])}")
            group.update(_hyperparameters(saved))
        inner_state = {self.inner_index[id(view)]: entry for view, entry in zip(self.views, entries) if entry}
        self.inner.load_state_dict({"state": inner_state, "param_groups": [
            dict(self._settings(group), params=[self.inner_index[id(v)] for v in mine["params"]])
            for group, mine in zip(self.owner.param_groups, self.inner.param_groups)]})
        self.gradients.drop_pending()

    def scatter_from(self, state_dict, root):
        """Collective: root's full state dict (None on the other ranks) loaded at every rank. Scalars travel
        pickled, each elementwise key as one broadcast per bucket, sliced at once (one bucket in memory)."""
        is_root = functions.rank() == root
        skeleton = None
        if is_root:
            shapes = {self.index_of[id(p)]: p.shape for p in self.params}
            skeleton = {"param_groups": state_dict["param_groups"], "state": {
                index: {key: (("tensor", value.dtype) if _is_elementwise(key, value, shapes.get(index))
                              else ("value", value)) for key, value in entry.items()}
                for index, entry in state_dict["state"].items()}}
        skeleton = functions.broadcast_object(skeleton, root_rank=root, name=f"{self.prefix}.scatter.skeleton",
                                              process_set=self.process_set)
        by_param = [skeleton["state"].get(self.index_of[id(p)], {}) for p in self.params]
        entries = [{key: _copy(spec[1]) for key, spec in by_param[piece.param].items() if spec[0] == "value"}
                   for piece in self.pieces]
        for b, bucket in enumerate(self.plan.buckets):
            keys = sorted({(key, spec[1]) for i in bucket.params for key, spec in by_param[i].items()
                           if spec[0] == "tensor"}, key=lambda kd: kd[0])
            for key, dtype in keys:
                if is_root:
                    whole = torch.cat([
                        state_dict["state"][self.index_of[id(self.params[i])]][key].reshape(-1).to(dtype)
                        if key in by_param[i] else torch.zeros(self.params[i].numel(), dtype=dtype)
                        for i in bucket.params])
                else:
                    whole = torch.empty(bucket.numel, dtype=dtype)
                functions.broadcast_(whole, root_rank=root, name=f"{self.prefix}.scatter{b}.{key}",
                                     process_set=self.process_set)
                for k, piece in enumerate(self.pieces):
                    if piece.bucket == b and key in by_param[piece.param]:
                        entries[k][key] = whole[piece.offset:piece.offset + piece.length].clone()
        self._load_pieces(entries, skeleton["param_groups"])

    def save_shards(self, path):
        self.wait_for_parameters()
        layout = {"format": "ringtrain.shards/1", "size": self.size, "plan": self.plan.describe(),
                  "param_groups": self._param_groups_for_saving()}
        shard = {"format": "ringtrain.shard/1", "rank": self.rank, "size": self.size,
                 "pieces": [(piece.param, piece.start, piece.length) for piece in self.pieces],
                 "state": [self.inner.state.get(view, {}) for view in self.views]}
        error = None
        try:
            write_atomically(f"{path}.shard{self.rank}", shard)
            if self.rank == 0:
                write_atomically(path, layout)
        except Exception as e:           # every rank learns of any rank's failure
            error = f"rank {functions.rank()}: {type(e).__name__}: {e}"
        errors = [e for e in functions.allgather_object(error, name=f"{self.prefix}.save_shards",
                                                        process_set=self.process_set) if e]
        if errors:
            raise RingtrainError(f"save_shards({path!r}) failed: {'; '.join(errors)}")

    def load_shards(self, path):
        """Each piece assembled from the old pieces that overlap it, whatever the old number of ranks; only the
        old shard files that hold such pieces are opened (memory-mapped)."""
        layout = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(layout, dict) or layout.get("format") != "ringtrain.shards/1":
            raise ValueError(f"{path!r} is not a layout written by save_shards")
        numels, buckets = layout["plan"]
        mine = [p.numel() for p in self.params]
        if list(numels) != mine:
            raise ValueError(f"{path!r} was saved for {len(numels)} parameters of sizes {list(numels)[:6]}..., this "
                             f"optimizer trains {len(mine)} of sizes {mine[:6]}...")
        old = ShardPlan(numels, buckets, layout["size"])
        wanted = {piece.param for piece in self.pieces}
        old_pieces = collections.defaultdict(list)
        for r in range(old.size):
            for k, piece in enumerate(old.pieces(r)):
                if piece.param in wanted:
                    old_pieces[piece.param].append(_OldPiece(r, k, piece.start, piece.length))
        files = {}
        for param in wanted:
            for old_piece in old_pieces[param]:
                if old_piece.rank not in files:
                    files[old_piece.rank] = torch.load(f"{path}.shard{old_piece.rank}", map_location="cpu",
                                                       weights_only=True, mmap=True)
        entries = []
        for piece in self.pieces:
            parts = overlaps(old_pieces[piece.param], piece.start, piece.length)
            entry = {}
            first = files[parts[0][0].rank]["state"][parts[0][0].index]
            for key, value in first.items():
                if not (isinstance(value, torch.Tensor) and value.dim() == 1 and key != "step"
                        and value.numel() == parts[0][0].length):
                    entry[key] = _copy(value)
                    continue
                out = torch.empty(piece.length, dtype=value.dtype)
                for old_piece, src, dst, count in parts:
                    out[dst:dst + count] = files[old_piece.rank]["state"][old_piece.index][key][src:src + count]
                entry[key] = out
            entries.append(entry)
        self._load_pieces(entries, layout["param_groups"])
        functions.barrier(process_set=self.process_set)     # nobody overwrites the files while others read them


# sharded optimizers with parameter allgathers in flight (gather_parameters="forward"), and the one global forward
# pre-hook that finishes them module by module: a module's forward waits only for the buckets of its own parameters
_GATHERING = weakref.WeakSet()
_forward_hook = None


def _finish_gathers_before_forward(module, args):
    for sharding in list(_GATHERING):
        sharding.before_forward(module)


def _install_forward_hook():
    global _forward_hook
    if _forward_hook is None:
        _forward_hook = torch.nn.modules.module.register_module_forward_pre_hook(_finish_gathers_before_forward)


class _ReplicatedGradients:
    """Stage 1: the gradients reduced by DistributedOptimizer's own GradientHooks (allreduce buckets, .grad views of
    them, either schedule); a piece's gradient is a view of its parameter's averaged .grad."""

    def __init__(self, owner, named_parameters, compression, backward_passes_per_step, op, gradient_predivide_factor,
                 bucket_cap_mb, first_bucket_mb, process_set, overlap):
        self.hooks = GradientHooks(owner, named_parameters, compression, backward_passes_per_step, op,
                                   gradient_predivide_factor, bucket_cap_mb, first_bucket_mb, None, True,
                                   process_set, overlap)

    def is_synchronized(self):
        return self.hooks.reducer.is_synchronized()

    def synchronize(self):
        self.hooks.synchronize()

    @staticmethod
    def piece_gradient(piece, param):
        # a view of the parameter's own .grad, so clipping or inspecting .grad sees the same numbers
        return param.grad.view(-1)[piece.start:piece.start + piece.length]

    def reopen(self):
        self.hooks.reducer.reopen()

    def zero_grad(self, set_to_none):
        return self.hooks.zero_grad(set_to_none)

    def drop_pending(self):
        self.hooks.drop_pending()


class _ScatteredGradients:
    """Stage 2: a Reducer of reducescatter buckets laid out as the shard plan's (user groups: never re-laid). A
    bucket of one parameter travels in its own .grad; several are packed into a flat tensor; either way the full
    gradients are dropped once submitted, and only this rank's shard of each bucket is kept."""

    def __init__(self, params, names, plan, rank, prefix, scaling, compression, process_set, passes_per_step,
                 overlap):
        self.params, self.plan, self.rank = params, plan, rank
        self.reducer = Reducer(parameter_members(params, names), prefix=prefix, scaling=scaling,
                               compression=compression, process_set=process_set, passes_per_step=passes_per_step,
                               overlap=overlap, groups=[[params[i] for i in b.params] for b in plan.buckets],
                               collective=Collective.REDUCESCATTER)
        self.shards = {}                 # bucket index -> this rank's block of the averaged bucket (1-D)
        host = [m.nbytes for m in self.reducer.members if m.host]
        if host:
            # every step backward makes each full gradient afresh and it is freed once reduce-scattered: keep the
            # freed blocks in the heap for the next step instead of faulting in fresh pages (as GradientHooks does)
            host_memory.keep_freed_blocks(max(host), sum(host))
        self.hooks = [p.register_post_accumulate_grad_hook(self._on_gradient) for p in params]

    def _on_gradient(self, param):
        bucket = self.reducer.arrived(param)
        if bucket is not None and self.reducer.overlap:
            self._submit(bucket, sync=False)

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

    def is_synchronized(self):
        return self.reducer.is_synchronized()

    def synchronize(self):
        reducer = self.reducer
        try:
            reducer.check_passes()
        except RingtrainError:
            reducer.drain()
            reducer.reset_step()
            raise
        try:
            reducer.submit_remaining(functools.partial(self._submit, sync=not reducer.overlap))
            with torch.no_grad():
                reducer.wait()
            reducer.learn_order()           # (the plan's buckets stay: only the phase moves on)
        except BaseException:
            reducer.reset_step()
            raise
        reducer.reset_step()
        reducer.mark_synchronized()

    def piece_gradient(self, piece, param):
        lo = piece.offset - self.plan.buckets[piece.bucket].block_starts[self.rank]
        return self.shards[piece.bucket][lo:lo + piece.length]

    def reopen(self):
        self.shards = {}
        self.reducer.reopen()

    def zero_grad(self, set_to_none):
        reducer = self.reducer
        if reducer.pending and reducer.only_failed_pending():
            reducer.reset_step()
        if reducer.pending:
            raise RingtrainError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step(): gradient buckets are still being reduce-scattered "
                                 f"(buckets {sorted(reducer.pending)})")
        reducer.reset_step()
        self.shards = {}
        return None

    def drop_pending(self):
        reducer = self.reducer
        if reducer.pending:
            try:
                reducer.drain()
            finally:
                reducer.reset_step()
        reducer.reset_step()
        reducer.reopen()
        self.shards = {}


class _OldPiece:
    __slots__ = ("rank", "index", "start", "length")

    def __init__(self, rank, index, start, length):
        self.rank, self.index, self.start, self.length = rank, index, start, length


def _is_elementwise(key, value, shape):
    """A state tensor shaped like its parameter holds one value per element (Adam's moments); the rest (step
    counts) belong to the whole parameter. A 0-d parameter's step is a 0-d tensor too: it goes by its name."""
    return (isinstance(value, torch.Tensor) and shape is not None and value.shape == shape
            and (len(shape) > 0 or key != "step"))


def _hyperparameters(group):
    return {key: value for key, value in group.items() if key != "params"}


def _implementation(accepted, groups, views):
    """How the inner optimizer steps the shard, where the user left it to torch (foreach and fused None in every
    group): with torch's fused kernel when the class has one and the shard is floating point on the CPU (one pass
    over memory per step instead of one per operation: Adam on 50 M parameters 0.04 s instead of 0.3 s), else with
    foreach (one call per operation for all of the shard's views). The update is the same algorithm. Returns the
    constructor keywords ({} where the user chose, or for a differentiable optimizer)."""
    keys = [key for key in _IMPLEMENTATION_KEYS if key in accepted]
    if not keys or any(group.get(key) is not None for group in groups for key in keys):
        return {}
    if any(group.get("differentiable") for group in groups):
        return {}
    if "fused" in keys and all(v.device.type == "cpu" and v.is_floating_point() for v in views):
        return {"fused": True}
    return {"foreach": True} if "foreach" in keys else {}


def _copy(value):
    return value.clone() if isinstance(value, torch.Tensor) else value


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
    wrapped._rt_sharding = _Sharding(wrapped, named_parameters, STAGES[shard], compression, backward_passes_per_step,
                                     op, gradient_predivide_factor, process_set, bucket_cap_mb, first_bucket_mb,
                                     overlap, gather_parameters)
    return wrapped

