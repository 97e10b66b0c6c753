"""Start every rank from the same point: broadcast parameters and optimizer state from one rank.

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

Tensors travel as in-place tensor broadcasts (all submitted, then waited on, so the engine fuses them); only the small
structure of the optimizer state (keys, shapes, hyper-parameters) travels pickled.
"""
import torch

from ringtrain.core.process_sets import global_process_set

from . import functions


def broadcast_parameters(params, root_rank: int = 0, prefix: str = "broadcast_parameters",
                         process_set=global_process_set) -> None:
    """Overwrite, in place, every tensor in `params` with root_rank's (a world rank; with `process_set`, among the
    set's ranks only).

    params: a state_dict (name -> tensor); an iterable of (name, tensor) pairs such as model.named_parameters() or
    a plain list of them; or of bare tensors such as model.parameters() (named by position, as Horovod allows).
    Every rank must pass the same names with the same shapes (a mismatch raises TensorMismatchError naming them).
    """
    if isinstance(params, dict):
        items = sorted(params.items())
    else:
        items = []
        for i, item in enumerate(params):
            if isinstance(item, torch.Tensor):
                items.append((f"param{i}", item))
            elif isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str):
                items.append(tuple(item))
            else:
                raise ValueError("broadcast_parameters expects a state_dict, (name, tensor) pairs such as "
                                 f"model.named_parameters(), or tensors; item {i} is a {type(item).__name__}")
    _broadcast_tensors_inplace([(f"{prefix}.{name}", t) for name, t in items if t is not None], root_rank,
                               process_set)


def _broadcast_tensors_inplace(named_tensors, root_rank, process_set=global_process_set):
    handles = []
    with torch.no_grad():
        for name, tensor in named_tensors:
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{name!r} is a {type(tensor).__name__}, not a tensor; use broadcast_object for it")
            # 0-d tensors (e.g. Adam's step) go as 1-element views of the same memory
            target = tensor.detach().view(1) if tensor.dim() == 0 else tensor.detach()
            handles.append(functions.broadcast_async_(target, root_rank, name=name, process_set=process_set))
        for handle in handles:
            handle.wait()   # results land in the tensors themselves (target shares their memory)


class _TensorSpec:
    """Stands in for a state tensor in the pickled structure: non-root ranks allocate it, then receive its data."""
    __slots__ = ("shape", "dtype")

    def __init__(self, tensor):
        self.shape, self.dtype = tuple(tensor.shape), tensor.dtype

    def allocate(self):
        return torch.empty(self.shape, dtype=self.dtype)


def _replace(obj, kind, fn):
    """obj with every instance of `kind` inside dicts, lists and tuples replaced by fn(instance)."""
    if isinstance(obj, kind):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _replace(v, kind, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_replace(v, kind, fn) for v in obj)
    return obj


def broadcast_optimizer_state(optimizer, root_rank: int = 0, model=None, process_set=global_process_set) -> None:
    """Make every rank's optimizer state and hyper-parameters (lr, momentum, ...) equal root_rank's (a world rank;
    with `process_set`, among the set's ranks only).

    Works whether or not the state exists yet: Adam before its first step has no state, and then every rank ends up
    with none (no warm-up step is taken, so Adam's step count and bias correction stay exactly as on one process).
    Works for wrapped (DistributedOptimizer) and plain torch optimizers. `model` is accepted for Horovod's
    signature, where it serves the dummy step that creates missing state; no dummy step is taken here, so it is
    not needed.
    """
    is_root = functions.rank() == root_rank
    if hasattr(optimizer, "scatter_state_dict"):
        # DistributedOptimizer(..., shard=...): the whole state gathered on the root, then each rank keeps its slices
        optimizer.consolidate_state_dict(to=root_rank)
        optimizer.scatter_state_dict(optimizer.state_dict() if is_root else None, root_rank=root_rank)
        return
    state_dict = optimizer.state_dict() if is_root else None
    skeleton = _replace(state_dict, torch.Tensor, _TensorSpec) if is_root else None
    skeleton = functions.broadcast_object(skeleton, root_rank=root_rank, name="broadcast_optimizer_state.skeleton",
                                          process_set=process_set)
    if not is_root:
        # load_state_dict checks group sizes against this rank's model and casts state to the parameters' device
        optimizer.load_state_dict(_replace(skeleton, _TensorSpec, _TensorSpec.allocate))
    _broadcast_tensors_inplace(list(_live_state_tensors(optimizer)), root_rank, process_set)


def _live_state_tensors(optimizer):
    """(name, tensor) for every tensor in optimizer.state, in an order that only depends on the model."""
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            state = optimizer.state.get(p, {})
            for key in sorted(state, key=str):
                if isinstance(state[key], torch.Tensor):
                    yield f"broadcast_optimizer_state.{g}.{i}.{key}", state[key]
