"""After a sharded optimizer's gradients are reduced: the update of this rank's shard (ShardUpdate: the user's
optimizer class over 1-D views of the parameters' memory) and the allgather that brings every rank's updated
blocks back into the parameters (ParameterGather: at the end of step(), or module by module during the next
forward)."""
import collections
import inspect
import weakref

import torch

from . import functions

# the keywords that choose how torch runs an optimizer's update, not what it computes
_IMPLEMENTATION_KEYS = ("foreach", "fused")


class ShardUpdate:
    """The user's optimizer class over this rank's pieces: 1-D views of the parameters' memory, grouped as the
    user's param_groups (so each piece keeps its group's lr, weight decay, ...). Its state is the shard's."""

    def __init__(self, base, owner, params, pieces):
        self.owner = owner
        group_of = {}
        for g, group in enumerate(owner.param_groups):
            for p in group["params"]:
                group_of[id(p)] = g
        self.views = []
        members = [[] for _ in owner.param_groups]
        for piece in pieces:
            p = params[piece.param]
            view = p.detach().view(-1)[piece.start:piece.start + piece.length]
            self.views.append(view)
            members[group_of[id(p)]].append(view)
        # the constructor's own keywords only (AdamW's defaults hold a decoupled_weight_decay it does not take)
        accepted = inspect.signature(base.__init__).parameters
        self.implementation = _implementation(accepted, owner.param_groups, self.views)
        groups = [dict(self.settings(group), params=params) for group, params in zip(owner.param_groups, members)]
        keywords = {k: v for k, v in owner.defaults.items() if k in accepted}
        self.inner = base(groups, **dict(keywords, **self.implementation))
        self.inner_index = {id(v): i for i, v in enumerate(v for g in groups for v in g["params"])}

    def settings(self, group):
        """What the inner optimizer's group for the user's `group` holds besides its views: the user's settings, and
        the implementation chosen for the shard (torch's load_state_dict replaces whole groups: it must come too)."""
        return dict(hyperparameters(group), **self.implementation)

    def step(self):
        for group, mine in zip(self.owner.param_groups, self.inner.param_groups):
            mine.update(self.settings(group))        # lr schedulers change the user's groups
        result = self.inner.step()
        for view in self.views:
            view.grad = None
        return result


class ParameterGather:
    """Every rank's updated block of each bucket, concatenated in rank order, is the whole bucket: the allgathers
    that unpack it into the parameters, at the end of step() or (in_forward) during the next forward."""

    def __init__(self, params, plan, pieces, views, prefix, process_set, in_forward):
        self.params, self.plan, self.pieces, self.views = params, plan, pieces, views
        self.prefix, self.process_set = prefix, process_set
        self.position = {id(p): i for i, p in enumerate(params)}
        self.in_forward = in_forward
        self.in_flight = {}                             # bucket -> allgather handle not yet unpacked
        if in_forward:
            _install_forward_hook()

    def after_step(self):
        if self.in_forward:
            self._start_for_forward()
        else:
            self._gather_all()

    def _start(self, b):
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

    def _gather_all(self):
        """Two buckets in flight at a time: peak extra memory is two buckets, not the model."""
        in_flight = collections.deque()
        with torch.no_grad():
            for b in range(len(self.plan.buckets)):
                in_flight.append((b, self._start(b)))
                if len(in_flight) > 1:
                    self._unpack(*in_flight.popleft())
            while in_flight:
                self._unpack(*in_flight.popleft())

    def _start_for_forward(self):
        """Start every bucket's allgather now, first layers first (buckets follow backward order), and unpack each
        when a module that owns one of its parameters starts its forward."""
        for b in reversed(range(len(self.plan.buckets))):
            self.in_flight[b] = self._start(b)
        _GATHERING.add(self)

    def before_forward(self, module):
        for p in module._parameters.values():
            b = self.plan.bucket_of[self.position[id(p)]] if p is not None and id(p) in self.position else None
            if b is not None and b in self.in_flight:
                with torch.no_grad():
                    self._unpack(b, self.in_flight.pop(b))
        if not self.in_flight:
            _GATHERING.discard(self)

    def wait(self):
        """Unpack every parameter allgather still in flight (gather_parameters="forward")."""
        with torch.no_grad():
            for b in sorted(self.in_flight, reverse=True):
                self._unpack(b, self.in_flight.pop(b))
        _GATHERING.discard(self)

    def _unpack(self, b, handle):
        whole = handle.wait()
        bucket = self.plan.buckets[b]
        if len(bucket.params) == 1:           # gathered in place (_start)
            return
        params = [self.params[i] for i in bucket.params]
        torch._foreach_copy_([p.detach().view(-1) for p in params],
                             [whole[s:s + p.numel()] for p, s in zip(params, bucket.starts)])


# parameter gathers in flight (gather_parameters="forward"), and the one global forward pre-hook that finishes them
# module by module: a module's forward waits only for the buckets of its own parameters
_GATHERING = weakref.WeakSet()
_forward_hook = None


def _finish_gathers_before_forward(module, args):
    for gather in list(_GATHERING):
        gather.before_forward(module)


def _install_forward_hook():
    global _forward_hook
    if _forward_hook is None:
        _forward_hook = torch.nn.modules.module.register_module_forward_pre_hook(_finish_gathers_before_forward)


def hyperparameters(group):
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
