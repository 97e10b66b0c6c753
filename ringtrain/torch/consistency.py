"""Are the parameters still identical on every rank? A check cheap enough to leave on in training.

    hvd.check_parameters(model.named_parameters())      # collective; raises ParameterDivergenceError naming
                                                         # the parameters and the ranks that differ
    RINGTRAIN_CHECK_EVERY=100 python train.py            # DistributedOptimizer.step() calls maybe_check()

Data-parallel ranks apply the same averaged gradient to the same parameters, so parameters must stay bitwise
equal; they drift apart when a rank skips a broadcast, uses a different seed for a non-broadcast buffer, runs
a different code path, or a kernel is non-deterministic. Each parameter is reduced to an 8-byte digest
(blake2b of its bytes on the CPU; on a GPU, float64 sum, sum of squares and a few strided samples, to avoid a
device-to-host copy of the whole model) and one allgather of the digests compares them.
"""
import hashlib
import os

import torch

from ringtrain.errors import RingtrainError
from ringtrain.core.process_sets import global_process_set

from . import functions

__all__ = ["check_parameters", "maybe_check", "ParameterDivergenceError"]

_SAMPLES = 16   # strided elements folded into a GPU digest next to the sums


class ParameterDivergenceError(RingtrainError):
    """Parameters that should be identical on every rank differ; the message names them and the ranks."""


def parameter_digest(tensor):
    """A digest of a tensor's values that equal tensors share: 8 bytes of blake2b (CPU) or of summary stats (GPU)."""
    t = tensor.detach()
    if t.is_cuda:
        flat = t.reshape(-1)
        wide = flat.to(torch.float64)
        step = max(1, flat.numel() // _SAMPLES)
        summary = torch.cat([wide.sum().view(1), (wide * wide).sum().view(1), wide[::step][:_SAMPLES]])
        data = summary.cpu().numpy().tobytes() + str((tuple(t.shape), t.dtype)).encode()
    else:
        flat = t.contiguous().reshape(-1)
        raw = flat.view(torch.uint8) if flat.numel() else flat   # any dtype (bfloat16 too) as its bytes
        data = raw.numpy().tobytes() + str((tuple(t.shape), t.dtype)).encode()
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def _ranks(ranks):
    ranks = sorted(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))}"


def describe_divergence(per_rank):
    """per_rank: list over ranks of [(name, digest), ...]. Returns a message, or None when all agree."""
    problems = []
    name_lists = [[name for name, _ in entries] for entries in per_rank]
    if any(names != name_lists[0] for names in name_lists):
        reference = set(name_lists[0])
        for rank, names in enumerate(name_lists[1:], start=1):
            extra, missing = sorted(set(names) - reference), sorted(reference - set(names))
            if extra or missing:
                problems.append(f"rank {rank} has parameters {extra[:5]} that rank 0 lacks and lacks {missing[:5]}")
    digests = [dict(entries) for entries in per_rank]
    for name in name_lists[0]:
        groups = {}
        for rank, table in enumerate(digests):
            if name in table:
                groups.setdefault(table[name], []).append(rank)
        if len(groups) > 1:
            # the largest group is taken as the right value: it names the few odd ranks out
            ordered = sorted(groups.values(), key=lambda rs: (-len(rs), rs[0]))
            others = "; ".join(f"{_ranks(rs)} differ" for rs in ordered[1:])
            problems.append(f"{name!r}: {_ranks(ordered[0])} agree, {others}")
    if not problems:
        return None
    shown = problems[:10] + ([f"... and {len(problems) - 10} more"] if len(problems) > 10 else [])
    return "parameters differ across ranks: " + "; ".join(shown)


def check_parameters(named_parameters, step: "int | None" = None, process_set=global_process_set) -> None:
    """Collective (over `process_set`): compare every parameter's digest across ranks; raise
    ParameterDivergenceError if any differ. named_parameters: model.named_parameters() or (name, tensor) pairs,
    the same names on every rank."""
    mine = [(name, parameter_digest(p)) for name, p in named_parameters]
    if not functions.is_initialized() or functions.size() == 1:
        return
    per_rank = functions.allgather_object(mine, name="ringtrain.consistency.digests", process_set=process_set)
    message = describe_divergence(per_rank)
    if message is not None:
        when = f" at step {step}" if step is not None else ""
        raise ParameterDivergenceError(message + when + " (RINGTRAIN_CHECK_EVERY found it; a rank skipped a "
                                       "broadcast_parameters, used other data-independent state, or ran other code)")


def check_every():
    """RINGTRAIN_CHECK_EVERY as configured at init (0 = off)."""
    if functions.is_initialized():
        from ringtrain.core.state import config
        return int(config().check_every or 0)
    return int(float(os.environ.get("RINGTRAIN_CHECK_EVERY", "0") or 0))


def maybe_check(step: int, named_parameters, process_set=global_process_set) -> bool:
    """The one-line hook for DistributedOptimizer.step(): check every RINGTRAIN_CHECK_EVERY-th step (1-based).
    named_parameters may be a list of (name, tensor) or a callable returning one (evaluated only when checking)."""
    every = check_every()
    if every <= 0 or step % every != 0:
        return False
    pairs = named_parameters() if callable(named_parameters) else named_parameters
    check_parameters(pairs, step=step, process_set=process_set)
    return True

