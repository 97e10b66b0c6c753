"""Lossless elastic recovery of a sharded optimizer (DistributedOptimizer(..., shard="optimizer" or "gradients")):
no rank holds the whole optimizer state, so each rank's shard is kept on one more rank as well, its ring neighbour
(rank r keeps a copy of rank r-1's shard: its parameters' values and its optimizer state), updated at every step.
Losing one worker then loses no state; losing a worker and, in the same failure, the neighbour that keeps its copy
does (an ElasticError names the shard).

How the copy stays current without sending the state each step: rank r steps a second optimizer of the user's
class over copies of rank r-1's pieces with rank r-1's averaged gradients, the same update rank r-1 makes. At
shard="optimizer" every rank holds the whole averaged gradient anyway; at shard="gradients" rank r-1 sends its
shard of them to rank r (one alltoall per step, a shard of gradients). Cost per rank: a second shard of optimizer
state and of parameters, a second shard update per step (and at shard="gradients" that alltoall).

Consistency: a shard's update is local and runs after the step's collectives, so each rank is either before or
after it (its `updates` count); a failure after it, in the parameter allgather, is held to the next step boundary
(the step counts as done: its own shard and the copy are updated). After a re-formation the new world takes, for
every old shard, the values and state of a holder (the owner or its neighbour) that is at the step the source rank
completed, and cuts them into the new world's shards (any number of ranks, as load_shards does).
"""
import collections
import pickle

import torch

from ringtrain.errors import ElasticError
from ringtrain.reducer.sharding import ShardPlan, overlaps

from . import functions, sharded_update
from .sharded import ShardedOptimizerMixin, _ScatteredGradients
from .sharded_checkpoint import _copy
from .sharded_update import ParameterGather, ShardUpdate


def is_sharded(optimizer):
    return isinstance(optimizer, ShardedOptimizerMixin)


class _Part:
    """One old piece of a parameter, with its values and optimizer state (what a holder hands over)."""
    __slots__ = ("start", "length", "state")

    def __init__(self, start, length, state):
        self.start, self.length, self.state = start, length, state


class ShardBackup:
    """The copy of the left neighbour's shard kept on this rank, the count of shard updates, and the re-formation
    of a sharded optimizer (a new plan for the new world, its shards rebuilt from the survivors' shards and
    copies)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.updates = 0                # shard updates made here (own shard and copy alike)
        self.held = None                # after a re-formation: the old world's shards this rank holds
        self.primed = False             # the copy holds the neighbour's state (it starts from it once)
        self._bind()

    @property
    def sharding(self):
        return self.optimizer._ringtrain

    def _bind(self):
        """The copy for this world's plan, and the update wrapped: neighbour's gradients, copy stepped, own step."""
        s = self.sharding
        self.left = (s.rank - 1) % s.size
        self.copy = None
        if s.size > 1:
            self.left_pieces = s.plan.pieces(self.left)
            self.copy = ShardUpdate(type(s.owner).__mro__[2], s.owner, s.params, self.left_pieces)
            copies = [view.detach().clone() for view in self.copy.views]
            swap = {id(view): c for view, c in zip(self.copy.views, copies)}
            for group in self.copy.inner.param_groups:
                group["params"] = [swap[id(view)] for view in group["params"]]
            self.copy.views = copies
        own_step = s.update.step

        def step():
            if self.copy is not None:
                self._step_copy()
            result = own_step()
            self.updates += 1
            return result
        s.update.step = step

    def _step_copy(self):
        """Collectives first (priming, the neighbour's gradients), then only local work: a failure leaves this rank
        wholly before the update."""
        s = self.sharding
        if not self.primed:
            left_state = _send_right([_clone_state(s.update.inner.state.get(v, {})) for v in s.update.views],
                                     f"{s.prefix}.backup.prime")
            for copy, entry in zip(self.copy.views, left_state):
                if entry:
                    self.copy.inner.state[copy] = entry
            self.primed = True
        grads = self._left_gradients()
        with torch.no_grad():
            for piece, copy, grad in zip(self.left_pieces, self.copy.views, grads):
                # the neighbour's values now (the last step's allgather brought them; the user may have set them)
                copy.copy_(s.params[piece.param].detach().view(-1)[piece.start:piece.start + piece.length])
                copy.grad = grad
        self.copy.step()

    def _left_gradients(self):
        s = self.sharding
        if s.stage == 1:        # every rank holds the whole averaged gradient
            grads = []
            for piece in self.left_pieces:
                g = s.params[piece.param].grad
                grads.append(None if g is None else g.view(-1)[piece.start:piece.start + piece.length])
            return grads
        mine = [s.gradients.piece_gradient(piece, s.params[piece.param]) for piece in s.pieces]
        like = s.params[0]
        flat = torch.cat(mine) if mine else torch.empty(0, dtype=like.dtype)
        splits = [0] * s.size
        splits[(s.rank + 1) % s.size] = flat.numel()
        received, _ = functions.alltoall_async(flat, splits=splits, name=f"{s.prefix}.backup.gradients",
                                               process_set=s.process_set).wait()
        out, at = [], 0
        for piece in self.left_pieces:
            out.append(received[at:at + piece.length])
            at += piece.length
        return out

    # ------------------------------------------------------------ a new world

    def world_changed(self):
        """After a re-formation, before sync (no collective): keep what this rank holds of the old world's shards,
        then lay the optimizer out for the new world (its state is rebuilt by restore())."""
        s = self.sharding
        held = {s.rank: self._parts(s.pieces, s.update.views, s.update.inner)}
        if self.copy is not None:
            held[self.left] = self._parts(self.left_pieces, self.copy.views, self.copy.inner)
        self.held = {"size": s.size, "plan": s.plan.describe(), "rank": s.rank, "updates": self.updates,
                     "shards": held}
        _relayout(s)
        self._bind()

    @staticmethod
    def _parts(pieces, views, inner):
        return [(piece.param, piece.start, piece.length, view.detach().clone(),
                 _clone_state(inner.state.get(view, {}))) for piece, view in zip(pieces, views)]

    def restore(self, root, steps):
        """Collective, every rank of the new world (a worker that joined holds nothing): each old shard from a
        holder at the update count of rank `root` (the source; None: the most any holder made), broadcast and cut
        into this world's shards. A no-op when nobody holds an old world's shards (the first sync). `steps`: this
        rank's completed steps."""
        s = self.sharding
        mine = {"steps": steps}
        if self.held is not None:
            mine.update({k: v for k, v in self.held.items() if k != "shards"}, holds=sorted(self.held["shards"]))
        everyone = functions.allgather_object(mine, name=f"{s.prefix}.backup.holders", process_set=s.process_set)
        holders = [(rank, info) for rank, info in enumerate(everyone) if "holds" in info]
        if not holders:
            return
        old_size = holders[0][1]["size"]
        target = max(info["updates"] for _, info in holders) if root is None else everyone[root]["steps"]
        parts = collections.defaultdict(list)        # param -> [_Part] of the old world, values and state
        values = collections.defaultdict(list)
        for j in range(old_size):
            ready = [rank for rank, info in holders if j in info["holds"] and info["updates"] == target]
            owner = [rank for rank in ready if everyone[rank]["rank"] == j]
            if not ready:
                raise ElasticError(
                    f"the optimizer state of shard {j} (of the {old_size} workers' world) is lost: no surviving "
                    f"worker holds it at step {target} (its worker and the neighbour that kept its copy, rank "
                    f"{(j + 1) % old_size} then, both died or fell behind); holders by rank: "
                    f"{[(rank, info['rank'], info['updates']) for rank, info in holders]}")
            root = (owner or ready)[0]
            shard = self.held["shards"][j] if functions.rank() == root else None
            shard = functions.broadcast_object(shard, root_rank=root, name=f"{s.prefix}.backup.shard{j}",
                                               process_set=s.process_set)
            for param, start, length, value, state in shard:
                values[param].append((start, value))
                parts[param].append(_Part(start, length, state))
        with torch.no_grad():
            for param, pieces in values.items():
                flat = s.params[param].detach().view(-1)
                for start, value in pieces:
                    flat[start:start + value.numel()].copy_(value)
        for view, entry in zip(s.update.views, _cut(s.pieces, parts)):
            if entry:
                s.update.inner.state[view] = entry
        if self.copy is not None:
            for copy, entry in zip(self.copy.views, _cut(self.left_pieces, parts)):
                if entry:
                    self.copy.inner.state[copy] = entry
        self.updates = target
        self.held = None
        self.primed = True


def _relayout(s):
    """The sharding `s` (a _Sharding) for the current world's size and rank: a new plan, its pieces, update and
    parameter gather; the gradients' reducer restarted (stage 1) or rebuilt on the new plan (stage 2). The
    optimizer state is empty afterwards."""
    sharded_update._GATHERING.discard(s.gather)      # the old world's gathers in flight are dead
    s.size = functions.size() if s.process_set.process_set_id == 0 else s.process_set.size()
    s.rank = s.process_set.rank()
    numels, buckets = s.plan.describe()
    s.plan = ShardPlan(numels, buckets, s.size)
    s.bucket_of = s.plan.bucket_of
    s.pieces = s.plan.pieces(s.rank)
    s.update = ShardUpdate(type(s.owner).__mro__[2], s.owner, s.params, s.pieces)
    settings = s.settings
    s.gather = ParameterGather(s.params, s.plan, s.pieces, s.update.views, s.prefix, s.process_set,
                               in_forward=settings["in_forward"])
    if s.stage == 1:
        s.gradients.hooks.restart()
    else:
        for hook in s.gradients.hooks:
            hook.remove()
        s.gradients = _ScatteredGradients(s.params, s.names, s.plan, s.rank, s.prefix, settings["scaling"],
                                          settings["compression"], s.process_set, settings["passes"],
                                          settings["overlap"])
    for p in s.params:
        p.grad = None


def _cut(pieces, parts):
    """The state of each of `pieces` (new plan), assembled from the old parts that overlap it."""
    entries = []
    for piece in pieces:
        found = overlaps(parts[piece.param], piece.start, piece.length)
        entry = {}
        for key, value in found[0][0].state.items():
            if not (isinstance(value, torch.Tensor) and value.dim() == 1 and key != "step"
                    and value.numel() == found[0][0].length):
                entry[key] = _copy(value)
                continue
            out = torch.empty(piece.length, dtype=value.dtype)
            for part, src, dst, count in found:
                out[dst:dst + count] = part.state[key][src:src + count]
            entry[key] = out
        entries.append(entry)
    return entries


def _clone_state(state):
    return {key: _copy(value) for key, value in state.items()}


def _send_right(obj, name):
    """`obj` to the next rank of the ring; returns the previous rank's (one alltoall of the pickled bytes)."""
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    splits = [0] * functions.size()
    splits[(functions.rank() + 1) % functions.size()] = payload.numel()
    received, _ = functions.alltoall_async(payload, splits=splits, name=name).wait()
    return pickle.loads(received.numpy().tobytes())
