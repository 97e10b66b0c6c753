"""A sharded optimizer's checkpoint I/O: its state consolidated on one rank as the unsharded optimizer's ordinary
torch state dict (and scattered back from one), a full state dict sliced at any number of ranks, and one file per
rank (save_shards / load_shards) resharded on load. Formats: "ringtrain.shards/1" (the layout) and
"ringtrain.shard/1" (one rank's pieces)."""
import collections

import torch

from ringtrain.errors import RingtrainError
from ringtrain.reducer.sharding import ShardPlan, overlaps

from . import functions
from .checkpoint import _write_atomically as write_atomically
from .sharded_update import hyperparameters


class ShardCheckpoint:
    """Reads and writes the state of one sharded optimizer (a _Sharding): its pieces, the inner optimizer's state of
    them and the user's param_groups."""

    def __init__(self, sharding):
        self.sharding = sharding
        self.consolidated = None

    def _elementwise(self, view, value):
        return isinstance(value, torch.Tensor) and value.dim() == 1 and value.shape == view.shape

    def consolidate(self, to):
        """Gather the whole state on world rank `to`, bucket by bucket: the scalars (step counts, ...) of each
        parameter travel pickled, each elementwise state key as one allgather of the ranks' blocks per bucket."""
        self.sharding.gather.wait()
        manifest = {}              # param -> {key: ("tensor", dtype) | ("value", value)}, from its first piece here
        for piece, view in zip(self.sharding.pieces, self.sharding.update.views):
            state = self.sharding.update.inner.state.get(view, {})
            if piece.param in manifest or not state:
                continue
            manifest[piece.param] = {key: ("tensor", value.dtype) if self._elementwise(view, value)
                                     else ("value", value) for key, value in state.items()}
        merged = {}
        for part in functions.allgather_object(manifest, name=f"{self.sharding.prefix}.manifest",
                                               process_set=self.sharding.process_set):
            merged.update(part)
        keep = functions.rank() == to
        state = {}
        by_bucket = collections.defaultdict(list)
        for piece, view in zip(self.sharding.pieces, self.sharding.update.views):
            by_bucket[piece.bucket].append((piece, view))
        for b, bucket in enumerate(self.sharding.plan.buckets):
            keys = sorted({(key, spec[1]) for i in bucket.params for key, spec in merged.get(i, {}).items()
                           if spec[0] == "tensor"}, key=lambda kd: kd[0])
            for key, dtype in keys:
                parts = []
                for piece, view in by_bucket[b]:
                    value = self.sharding.update.inner.state.get(view, {}).get(key)
                    parts.append(value if value is not None else torch.zeros(piece.length, dtype=dtype))
                block = torch.cat(parts) if parts else torch.empty(0, dtype=dtype)
                whole = functions.allgather_async(block.to(dtype), name=f"{self.sharding.prefix}.state{b}.{key}",
                                                  process_set=self.sharding.process_set).wait()
                if keep:
                    for i, start in zip(bucket.params, bucket.starts):
                        if key in merged.get(i, {}):
                            p = self.sharding.params[i]
                            state.setdefault(i, {})[key] = whole[start:start + p.numel()].view_as(p).clone()
        if keep:
            full = {}
            for i, p in enumerate(self.sharding.params):
                if i not in merged:
                    continue
                entry = {key: (state[i][key] if spec[0] == "tensor" else _copy(spec[1]))
                         for key, spec in merged[i].items()}
                full[self.sharding.index_of[id(p)]] = entry
            self.consolidated = {"state": full, "param_groups": self._param_groups_for_saving()}
        else:
            self.consolidated = None

    def _param_groups_for_saving(self):
        groups = []
        for group in self.sharding.owner.param_groups:
            groups.append(dict(hyperparameters(group), params=[self.sharding.index_of[id(p)] for p in group["params"]]))
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
        for piece in self.sharding.pieces:
            p = self.sharding.params[piece.param]
            entry = {}
            for key, value in saved.get(self.sharding.index_of[id(p)], {}).items():
                if _is_elementwise(key, value, p.shape):
                    entry[key] = value.reshape(-1)[piece.start:piece.start + piece.length].clone()
                else:
                    entry[key] = _copy(value)
            entries.append(entry)
        self._load_pieces(entries, state_dict["param_groups"])

    def _load_pieces(self, entries, param_groups):
        """entries[k] = this rank's k-th piece's state ({key: value}); loads them into the inner optimizer and the
        saved hyper-parameters into the user's groups."""
        self.sharding.gather.wait()
        if len(param_groups) != len(self.sharding.owner.param_groups):
            raise ValueError(f"the state dict has {len(param_groups)} parameter groups, this optimizer "
                             f"{len(self.sharding.owner.param_groups)}")
        for group, saved in zip(self.sharding.owner.param_groups, param_groups):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(f"a saved parameter group has {len(saved['params'])} parameters, this "
                                 f"optimizer's {len(group['params'])}")
            group.update(hyperparameters(saved))
        inner_state = {self.sharding.update.inner_index[id(view)]: entry for view, entry in zip(self.sharding.update.views, entries) if entry}
        self.sharding.update.inner.load_state_dict({"state": inner_state, "param_groups": [
            dict(self.sharding.update.settings(group), params=[self.sharding.update.inner_index[id(v)] for v in mine["params"]])
            for group, mine in zip(self.sharding.owner.param_groups, self.sharding.update.inner.param_groups)]})
        self.sharding.gradients.drop_pending()

    def scatter_from(self, state_dict, root):
        """Collective: root's full state dict (None on the other ranks) loaded at every rank. Scalars travel
        pickled, each elementwise key as one broadcast per bucket, sliced at once (one bucket in memory)."""
        is_root = functions.rank() == root
        skeleton = None
        if is_root:
            shapes = {self.sharding.index_of[id(p)]: p.shape for p in self.sharding.params}
            skeleton = {"param_groups": state_dict["param_groups"], "state": {
                index: {key: (("tensor", value.dtype) if _is_elementwise(key, value, shapes.get(index))
                              else ("value", value)) for key, value in entry.items()}
                for index, entry in state_dict["state"].items()}}
        skeleton = functions.broadcast_object(skeleton, root_rank=root, name=f"{self.sharding.prefix}.scatter.skeleton",
                                              process_set=self.sharding.process_set)
        by_param = [skeleton["state"].get(self.sharding.index_of[id(p)], {}) for p in self.sharding.params]
        entries = [{key: _copy(spec[1]) for key, spec in by_param[piece.param].items() if spec[0] == "value"}
                   for piece in self.sharding.pieces]
        for b, bucket in enumerate(self.sharding.plan.buckets):
            keys = sorted({(key, spec[1]) for i in bucket.params for key, spec in by_param[i].items()
                           if spec[0] == "tensor"}, key=lambda kd: kd[0])
            for key, dtype in keys:
                if is_root:
                    whole = torch.cat([
                        state_dict["state"][self.sharding.index_of[id(self.sharding.params[i])]][key].reshape(-1).to(dtype)
                        if key in by_param[i] else torch.zeros(self.sharding.params[i].numel(), dtype=dtype)
                        for i in bucket.params])
                else:
                    whole = torch.empty(bucket.numel, dtype=dtype)
                functions.broadcast_(whole, root_rank=root, name=f"{self.sharding.prefix}.scatter{b}.{key}",
                                     process_set=self.sharding.process_set)
                for k, piece in enumerate(self.sharding.pieces):
                    if piece.bucket == b and key in by_param[piece.param]:
                        entries[k][key] = whole[piece.offset:piece.offset + piece.length].clone()
        self._load_pieces(entries, skeleton["param_groups"])

    def save_shards(self, path):
        self.sharding.gather.wait()
        layout = {"format": "ringtrain.shards/1", "size": self.sharding.size, "plan": self.sharding.plan.describe(),
                  "param_groups": self._param_groups_for_saving()}
        shard = {"format": "ringtrain.shard/1", "rank": self.sharding.rank, "size": self.sharding.size,
                 "pieces": [(piece.param, piece.start, piece.length) for piece in self.sharding.pieces],
                 "state": [self.sharding.update.inner.state.get(view, {}) for view in self.sharding.update.views]}
        error = None
        try:
            write_atomically(f"{path}.shard{self.sharding.rank}", shard)
            if self.sharding.rank == 0:
                write_atomically(path, layout)
        except Exception as e:           # every rank learns of any rank's failure
            error = f"rank {functions.rank()}: {type(e).__name__}: {e}"
        errors = [e for e in functions.allgather_object(error, name=f"{self.sharding.prefix}.save_shards",
                                                        process_set=self.sharding.process_set) if e]
        if errors:
            raise RingtrainError(f"save_shards({path!r}) failed: {'; '.join(errors)}")

    def load_shards(self, path):
        """Each piece assembled from the old pieces that overlap it, whatever the old number of ranks; only the
        old shard files that hold such pieces are opened (memory-mapped)."""
        layout = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(layout, dict) or layout.get("format") != "ringtrain.shards/1":
            raise ValueError(f"{path!r} is not a layout written by save_shards")
        numels, buckets = layout["plan"]
        mine = [p.numel() for p in self.sharding.params]
        if list(numels) != mine:
            raise ValueError(f"{path!r} was saved for {len(numels)} parameters of sizes {list(numels)[:6]}..., this "
                             f"optimizer trains {len(mine)} of sizes {mine[:6]}...")
        old = ShardPlan(numels, buckets, layout["size"])
        wanted = {piece.param for piece in self.sharding.pieces}
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
        for piece in self.sharding.pieces:
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
        functions.barrier(process_set=self.sharding.process_set)     # nobody overwrites the files while others read them


class _OldPiece:
    __slots__ = ("rank", "index", "start", "length")

    def __init__(self, rank, index, start, length):
        self.rank, self.index, self.start, self.length = rank, index, start, length


def _is_elementwise(key, value, shape):
    """A state tensor shaped like its parameter holds one value per element (Adam's moments); the rest (step
    counts) belong to the whole parameter. A 0-d parameter's step is a 0-d tensor too: it goes by its name."""
    return (isinstance(value, torch.Tensor) and shape is not None and value.shape == shape
            and (len(shape) > 0 or key != "step"))


def _copy(value):
    return value.clone() if isinstance(value, torch.Tensor) else value
