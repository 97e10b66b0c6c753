"""Sharded optimizer (ZeRO stages 1 and 2) on N ranks == one plain torch optimizer on the concatenated batch.

Every rank computes the one-process reference itself from fixed seeds. Models are cut into several buckets whose
sizes do not divide by 2, 3 or 4, so pieces of one parameter live on different ranks.
"""
import os
import tempfile

import numpy as np
import pytest
import torch

import ringtrain.torch as hvd
from ringtrain.errors import RingtrainError

pytestmark = pytest.mark.mpi(min_size=2)

SHARD = 2                 # rows per rank per backward pass
CAPS = dict(first_bucket_mb=0.0002, bucket_cap_mb=0.0004)    # 210 / 420 bytes: 4 buckets of float64


@pytest.fixture(scope="module")
def rt():
    if not hvd.is_initialized():
        hvd.init()
    return hvd


def make_model(seed=3):
    torch.manual_seed(seed)           # 7*11 + 11 + 11*5 + 5 + 5*3 + 3 = 166 parameters, in 6 tensors
    return torch.nn.Sequential(torch.nn.Linear(7, 11), torch.nn.Tanh(), torch.nn.Linear(11, 5), torch.nn.Tanh(),
                               torch.nn.Linear(5, 3)).double()


def batches(rows, steps, passes=1, seed=9):
    generator = torch.Generator().manual_seed(seed)
    return [[(torch.randn(rows, 7, generator=generator, dtype=torch.float64),
              torch.randn(rows, 3, generator=generator, dtype=torch.float64)) for _ in range(passes)]
            for _ in range(steps)]


OPTIMIZERS = {
    "sgd_momentum": (lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9), 1e-10),
    "adam": (lambda params: torch.optim.Adam(params, lr=0.01), 1e-8),
    "adamw": (lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1), 1e-8),
}
# every other torch.optim optimizer whose update is elementwise, at tolerances its arithmetic allows
MORE_OPTIMIZERS = {
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=0.1),
    "rmsprop": lambda params: torch.optim.RMSprop(params, lr=0.01, momentum=0.5),
    "nadam": lambda params: torch.optim.NAdam(params, lr=0.01),
    "radam": lambda params: torch.optim.RAdam(params, lr=0.01),
    "adamax": lambda params: torch.optim.Adamax(params, lr=0.01),
    "adadelta": lambda params: torch.optim.Adadelta(params, lr=1.0),
    "rprop": lambda params: torch.optim.Rprop(params, lr=0.01),
    "asgd": lambda params: torch.optim.ASGD(params, lr=0.05, t0=1),
    "sgd_nesterov_groups": lambda params: torch.optim.SGD(
        [{"params": params[:3], "lr": 0.05}, {"params": params[3:], "weight_decay": 0.01}],
        lr=0.1, momentum=0.9, nesterov=True),
}


def loss_of(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def train_reference(make, data, model=None, opt=None, rows_of=None):
    """One process, plain torch, on the whole batch of each pass (k passes accumulate)."""
    model = model or make_model()
    opt = opt or make(list(model.parameters()))
    for step in data:
        opt.zero_grad()
        for x, y in step:
            loss_of(model, x, y).backward()
        opt.step()
    return model, opt


def shard(opt, model, stage, **options):
    return hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), shard=stage, **options)


def train_sharded(rt, make, data, stage, model=None, opt=None, rank=None, size=None, **options):
    rank = rt.rank() if rank is None else rank
    size = rt.size() if size is None else size
    if model is None:
        model = make_model(seed=100 + rank)               # a different start: broadcast_parameters must fix it
        model.load_state_dict(make_model().state_dict()) if rank == 0 else None
        opt = shard(make(list(model.parameters())), model, stage, **options)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0, process_set=options.get("process_set",
                                                                                             hvd.global_process_set))
    rows = len(data[0][0][0]) // size
    lo, hi = rank * rows, (rank + 1) * rows
    for step in data:
        opt.zero_grad()
        for x, y in step:
            loss_of(model, x[lo:hi], y[lo:hi]).backward()
        opt.step()
    return model, opt


def assert_close_models(got, want, rtol, what):
    wrong = [f"{name} (max |diff| {(p - q).abs().max().item():.3g})"
             for (name, p), q in zip(got.named_parameters(), want.parameters())
             if not torch.allclose(p, q, rtol=rtol, atol=rtol * 1e-2)]
    assert not wrong, f"{what}: differs from one process in {', '.join(wrong)}"


def assert_moved(model):
    start = make_model()
    moved = max((p - q).abs().max().item() for p, q in zip(model.parameters(), start.parameters()))
    assert moved > 1e-3, f"training barely moved the model ({moved}): the comparison would be vacuous"


def assert_same_on_all_ranks(rt, model, name, process_set=hvd.global_process_set):
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    for r, other in enumerate(rt.allgather_object(flat, name=name, process_set=process_set)):
        np.testing.assert_array_equal(other, flat, err_msg=f"rank {r} of the set differs from this one")


STAGES = pytest.mark.parametrize("stage", ["optimizer", "gradients"])


@STAGES
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_n_ranks_equal_one_process(rt, stage, optimizer):
    make, rtol = OPTIMIZERS[optimizer]
    data = batches(rt.size() * SHARD, steps=4)
    model, opt = train_sharded(rt, make, data, stage, **CAPS)
    assert len(opt._ringtrain.plan.buckets) >= 4
    reference, _ = train_reference(make, data)
    assert_moved(reference)
    assert_close_models(model, reference, rtol, f"{optimizer}, shard={stage}, {rt.size()} ranks")
    assert_same_on_all_ranks(rt, model, f"check.sharded.{stage}.{optimizer}")


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "after_backward"])
@pytest.mark.parametrize("passes", [1, 2])
@STAGES
def test_schedules_and_accumulated_passes(rt, stage, passes, overlap):
    make, rtol = OPTIMIZERS["sgd_momentum"]
    data = batches(rt.size() * SHARD, steps=3, passes=passes)
    model, _ = train_sharded(rt, make, data, stage, backward_passes_per_step=passes, overlap=overlap, **CAPS)
    reference, _ = train_reference(make, data)
    assert_close_models(model, reference, rtol, f"shard={stage}, {passes} passes, overlap={overlap}")


@pytest.mark.parametrize("optimizer", sorted(MORE_OPTIMIZERS))
def test_every_elementwise_torch_optimizer(rt, optimizer):
    make = MORE_OPTIMIZERS[optimizer]
    data = batches(rt.size() * SHARD, steps=3)
    model, _ = train_sharded(rt, make, data, "gradients", **CAPS)
    reference, _ = train_reference(make, data)
    assert_moved(reference)
    assert_close_models(model, reference, 1e-7, f"{optimizer}, shard=gradients")


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
@STAGES
def test_compressed_gradients_stay_close(rt, stage, compression):
    make, _ = OPTIMIZERS["adam"]
    data = batches(rt.size() * SHARD, steps=3)
    model, _ = train_sharded(rt, make, data, stage, compression=getattr(hvd.Compression, compression), **CAPS)
    reference, _ = train_reference(make, data)
    assert_close_models(model, reference, 0.05, f"{compression}, shard={stage}")


@STAGES
def test_clip_grad_norm_uses_the_whole_models_norm(rt, stage):
    make, rtol = OPTIMIZERS["sgd_momentum"]
    data = batches(rt.size() * SHARD, steps=3)
    model = make_model()
    opt = shard(make(list(model.parameters())), model, stage, **CAPS)
    reference = make_model()
    ref_opt = make(list(reference.parameters()))
    lo, hi = rt.rank() * SHARD, (rt.rank() + 1) * SHARD
    for step in data:
        (x, y), = step
        opt.zero_grad()
        loss_of(model, x[lo:hi], y[lo:hi]).backward()
        norm = opt.clip_grad_norm_(0.05)
        opt.step()
        ref_opt.zero_grad()
        loss_of(reference, x, y).backward()
        want = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        ref_opt.step()
        assert want > 0.1, "the reference norm must be well above max_norm, or clipping is not exercised"
        torch.testing.assert_close(norm, want, rtol=1e-9, atol=0)
    assert_close_models(model, reference, rtol, f"clipped, shard={stage}")


def test_stage_two_keeps_only_its_shard_of_the_gradients(rt):
    make, _ = OPTIMIZERS["adam"]
    model = make_model()
    opt = shard(make(list(model.parameters())), model, "gradients", **CAPS)
    x, y = batches(SHARD, steps=1)[0][0]
    loss_of(model, x, y).backward()
    assert all(p.grad is None for p in model.parameters()), "stage 2 must free each bucket's full gradients"
    opt.step()
    total = sum(p.numel() for p in model.parameters())
    state = sum(v.numel() for s in opt._ringtrain.update.inner.state.values() for v in s.values() if v.dim() == 1)
    mine = opt.shard_numel()
    everyone = rt.allgather_object(mine, name="check.shard_numel")
    assert sum(everyone) == total and max(everyone) - min(everyone) <= len(opt._ringtrain.plan.buckets)
    assert state == 2 * mine, f"Adam keeps 2 moments of this rank's {mine} elements, found {state} elements"


def test_shard_steps_with_torchs_fused_kernel_unless_the_user_chose(rt):
    """Left to torch (foreach and fused None), the shard's views are stepped by the fused kernel, step after step
    (the user's groups, synced in every step for lr schedulers, must not switch it back); a user's choice stands."""
    data = batches(rt.size() * SHARD, steps=2)
    for make, want in ((lambda params: torch.optim.AdamW(params, lr=0.01), {"fused": True, "foreach": None}),
                       (lambda params: torch.optim.Rprop(params, lr=0.01), {"foreach": True}),
                       (lambda params: torch.optim.Adam(params, lr=0.01, foreach=False),
                        {"fused": None, "foreach": False})):
        model, opt = train_sharded(rt, make, data, "optimizer", **CAPS)
        reference, ref_opt = train_reference(make, data)
        assert_close_models(model, reference, 1e-8, f"{type(opt).__mro__[2].__name__}")
        for when in ("after steps", "after load_state_dict"):
            for group in opt._ringtrain.update.inner.param_groups:
                assert {key: group[key] for key in want} == want, f"{type(opt).__mro__[2].__name__} {when}: {group}"
            assert all(group.get("fused") in (None, False) for group in opt.param_groups), "the user's groups changed"
            opt.load_state_dict(ref_opt.state_dict())


def test_unused_parameters_and_a_bucket_smaller_than_the_ranks(rt):
    """A parameter no rank uses (its bucket never completes during backward) and 1-element tensors: no hang, and
    the same result as one process (which gives the unused parameter no update)."""
    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(5)
            self.body = torch.nn.Linear(7, 3).double()
            self.unused = torch.nn.Linear(3, 3).double()
            self.scale = torch.nn.Parameter(torch.ones(1, dtype=torch.float64))

        def forward(self, x):
            return self.body(x) * self.scale

    make = lambda params: torch.optim.SGD(params, lr=0.1)   # noqa: E731  (zero gradients move nothing)
    data = batches(rt.size() * SHARD, steps=3)
    model, reference = Branchy(), Branchy()
    opt = shard(make(list(model.parameters())), model, "gradients", first_bucket_mb=0.00001, bucket_cap_mb=0.00001)
    train_sharded(rt, make, data, "gradients", model=model, opt=opt)
    train_reference(make, data, model=reference)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")


def test_process_set_trains_among_its_ranks_only(rt):
    members = list(range(rt.size() - 1))          # all but the last rank
    subset = rt.add_process_set(members)
    try:
        if subset.included():
            make, rtol = OPTIMIZERS["adam"]
            data = batches(len(members) * SHARD, steps=3)
            model, _ = train_sharded(rt, make, data, "gradients", rank=subset.rank(), size=len(members),
                                     process_set=subset, **CAPS)
            reference, _ = train_reference(make, data)
            assert_close_models(model, reference, rtol, f"process set {members}")
    finally:
        rt.remove_process_set(subset)


@STAGES
def test_uneven_inputs_with_join(rt, stage):
    """Rank r has 4 - r steps of data, then calls optimizer.join(); the remaining steps average over the full size
    with zeros from the joined ranks, as DistributedOptimizer's join."""
    n = rt.size()
    steps_of = [max(4 - r, 1) for r in range(n)]
    make, rtol = OPTIMIZERS["sgd_momentum"]
    data = batches(n * SHARD, steps=max(steps_of))
    model, opt = train_sharded(rt, make, data[:steps_of[rt.rank()]], stage, **CAPS)
    assert opt.join() == 0
    reference = make_model()
    ref_opt = make(list(reference.parameters()))
    for s, ((x, y),) in enumerate(data):
        ref_opt.zero_grad()
        active = [r for r in range(n) if s < steps_of[r]]
        (sum(loss_of(reference, x[r * SHARD:(r + 1) * SHARD], y[r * SHARD:(r + 1) * SHARD]) for r in active)
         / n).backward()
        ref_opt.step()
    assert_close_models(model, reference, rtol, f"join, shard={stage}")
    assert_same_on_all_ranks(rt, model, f"check.sharded.join.{stage}")


def test_refuses_optimizers_that_are_not_elementwise_and_unconsolidated_state_dict(rt):
    model = make_model()
    with pytest.raises(ValueError, match="LBFGS"):
        shard(torch.optim.LBFGS(model.parameters()), model, "optimizer")
    with pytest.raises(ValueError, match="shard must be one of"):
        shard(torch.optim.SGD(model.parameters(), lr=0.1), model, "parameters")
    opt = shard(torch.optim.SGD(model.parameters(), lr=0.1), model, "optimizer")
    with pytest.raises(RingtrainError, match="consolidate_state_dict"):
        opt.state_dict()


# ------------------------------------------------------------------------------------------------ checkpoints

def shared_directory(rt):
    path = tempfile.mkdtemp(prefix="ringtrain-shards-") if rt.rank() == 0 else None
    return rt.broadcast_object(path, root_rank=0, name="check.sharded.tmpdir")


def test_consolidated_state_dict_is_the_plain_optimizers(rt):
    make, _ = OPTIMIZERS["adam"]
    data = batches(rt.size() * SHARD, steps=2)
    _, opt = train_sharded(rt, make, data, "gradients", **CAPS)
    opt.consolidate_state_dict(to=rt.size() - 1)
    if rt.rank() != rt.size() - 1:
        with pytest.raises(RingtrainError):
            opt.state_dict()
        return
    got = opt.state_dict()
    _, ref_opt = train_reference(make, data)
    want = ref_opt.state_dict()
    assert got["param_groups"] == want["param_groups"]
    assert sorted(got["state"]) == sorted(want["state"])
    for index, entry in want["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(got["state"][index][key], value, rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("form", ["consolidated", "per_shard"])
def test_save_then_load_at_every_smaller_rank_count_continues_training(rt, form):
    """Save at N ranks after 3 steps; load at every m in 1..N (the first m ranks, as a process set) and train 3
    more steps: equal to one process that never stopped, and at m == N bit-identical to a sharded run that never
    stopped."""
    n = rt.size()
    make, rtol = OPTIMIZERS["adamw"]
    rows = 12                                   # divides by 1, 2, 3 and 4 ranks
    data = batches(rows, steps=6)
    directory = shared_directory(rt)
    path = os.path.join(directory, "opt.pt")
    model, opt = train_sharded(rt, make, data[:3], "gradients", **CAPS)
    if form == "consolidated":
        opt.consolidate_state_dict(to=0)
        saved = opt.state_dict() if rt.rank() == 0 else None
        saved = rt.broadcast_object(saved, root_rank=0, name="check.sharded.saved")
    else:
        opt.save_shards(path)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    unstopped, _ = train_sharded(rt, make, data[3:], "gradients", model=model, opt=opt)
    reference, _ = train_reference(make, data)
    assert_close_models(unstopped, reference, rtol, "unstopped")

    for m in range(1, n + 1):
        subset = rt.add_process_set(list(range(m))) if m < n else rt.global_process_set
        try:
            if subset.included():
                resumed = make_model()
                resumed.load_state_dict(weights)
                ropt = shard(make(list(resumed.parameters())), resumed, "gradients", process_set=subset, **CAPS)
                ropt.load_state_dict(saved) if form == "consolidated" else ropt.load_shards(path)
                train_sharded(rt, make, data[3:], "gradients", model=resumed, opt=ropt, rank=subset.rank(), size=m)
                assert_close_models(resumed, reference, rtol, f"saved at {n}, loaded at {m} ({form})")
                if m == n:
                    for (name, p), q in zip(resumed.named_parameters(), unstopped.parameters()):
                        assert torch.equal(p, q), f"{name}: loaded at the same rank count but not bit-identical"
        finally:
            if m < n:
                rt.remove_process_set(subset)


@pytest.mark.parametrize("form", ["consolidated", "per_shard"])
def test_save_at_every_rank_count_then_load_at_all_ranks_with_other_buckets(rt, form):
    """Save at m ranks (the first m, as a process set; m = 1..N) after 3 steps; load at all N ranks into an
    optimizer whose buckets differ from the saved ones (bucket_cap_mb changed between save and load) and train 3
    more steps: equal to one process that never stopped. Resharding upward and across bucket layouts."""
    n = rt.size()
    make, rtol = OPTIMIZERS["adamw"]
    data = batches(12, steps=6)                   # 12 rows divide by 1, 2, 3 and 4 ranks
    reference, _ = train_reference(make, data)
    other_caps = dict(first_bucket_mb=0.0003, bucket_cap_mb=0.0009)
    directory = shared_directory(rt)
    for m in range(1, n + 1):
        path = os.path.join(directory, f"opt_at_{m}.pt")
        subset = rt.add_process_set(list(range(m))) if m < n else rt.global_process_set
        saved = weights = None
        try:
            if subset.included():
                model, opt = train_sharded(rt, make, data[:3], "gradients", rank=subset.rank(), size=m,
                                           process_set=subset, **CAPS)
                if form == "consolidated":
                    opt.consolidate_state_dict(to=0)
                    saved = opt.state_dict() if subset.rank() == 0 else None
                else:
                    opt.save_shards(path)
                weights = {k: v.clone() for k, v in model.state_dict().items()}
        finally:
            if m < n:
                rt.remove_process_set(subset)
        saved = rt.broadcast_object(saved, root_rank=0, name=f"check.sharded.upward.saved.{m}")
        weights = rt.broadcast_object(weights, root_rank=0, name=f"check.sharded.upward.weights.{m}")
        resumed = make_model(seed=60)
        resumed.load_state_dict(weights)
        ropt = shard(make(list(resumed.parameters())), resumed, "gradients", **other_caps)
        ropt.load_state_dict(saved) if form == "consolidated" else ropt.load_shards(path)
        train_sharded(rt, make, data[3:], "gradients", model=resumed, opt=ropt)
        assert_close_models(resumed, reference, rtol, f"saved at {m}, loaded at {n} with other buckets ({form})")


def test_save_checkpoint_and_load_checkpoint_reshard_through_rank_zero(rt):
    make, rtol = OPTIMIZERS["adam"]
    data = batches(rt.size() * SHARD, steps=4)
    directory = shared_directory(rt)
    path = os.path.join(directory, "ckpt.pt")
    model, opt = train_sharded(rt, make, data[:2], "optimizer", **CAPS)
    rt.save_checkpoint(path, model, opt, step=2)
    resumed = make_model(seed=50)
    ropt = shard(make(list(resumed.parameters())), resumed, "gradients", **CAPS)   # another stage: same format
    assert rt.load_checkpoint(path, resumed, ropt) == {"step": 2}
    train_sharded(rt, make, data[2:], "gradients", model=resumed, opt=ropt)
    reference, _ = train_reference(make, data)
    assert_close_models(resumed, reference, rtol, "checkpoint through save_checkpoint/load_checkpoint")


@STAGES
def test_parameter_allgather_during_the_next_forward(rt, stage):
    """gather_parameters="forward": step() returns with allgathers in flight; each layer's forward waits for its own
    parameters. Same result as one process."""
    make, rtol = OPTIMIZERS["adam"]
    data = batches(rt.size() * SHARD, steps=4)
    model, opt = train_sharded(rt, make, data[:3], stage, gather_parameters="forward", **CAPS)
    assert opt._ringtrain.gather.in_flight, "step() should leave the parameter allgathers in flight"
    train_sharded(rt, make, data[3:], stage, model=model, opt=opt)
    opt.wait_for_parameters()
    reference, _ = train_reference(make, data)
    assert_close_models(model, reference, rtol, f"gather_parameters=forward, shard={stage}")
    assert_same_on_all_ranks(rt, model, f"check.sharded.forward_gather.{stage}")


def test_broadcast_optimizer_state_gives_every_rank_roots_hyperparameters_and_keeps_the_shards(rt):
    make, rtol = OPTIMIZERS["adam"]
    data = batches(rt.size() * SHARD, steps=4)
    model, opt = train_sharded(rt, make, data[:2], "gradients", **CAPS)
    for group in opt.param_groups:
        group["lr"] = 0.02 if rt.rank() == 0 else 123.0      # only the root's value may survive
    rt.broadcast_optimizer_state(opt, root_rank=0)
    assert all(group["lr"] == 0.02 for group in opt.param_groups)
    train_sharded(rt, make, data[2:], "gradients", model=model, opt=opt)
    reference, ref_opt = train_reference(make, data[:2])
    for group in ref_opt.param_groups:
        group["lr"] = 0.02
    train_reference(make, data[2:], model=reference, opt=ref_opt)
    assert_close_models(model, reference, rtol, "after broadcast_optimizer_state")
