"""DistributedOptimizer on N ranks == one process on the concatenated batch, for the layouts an engine rewrite can
break: models spanning several fusion buckets (small caps, and a model over the default caps) and a model of
hundreds of small tensors. A bug confined to one bucket (the last bucket reduced with Sum, a wrong scale for one
bucket, a tensor unpacked into its neighbour's slot) changes the trained weights here, not only on some ranks.

Only the public API is used, so the checks hold whatever the engine does inside (one request per bucket or per
tensor, any agreement protocol). Every rank computes the one-process reference itself from fixed seeds.
"""
import pytest
import torch

import ringtrain.torch as hvd

pytestmark = pytest.mark.mpi(min_size=2)

SHARD = 2           # rows per rank per step: rank r trains on rows r*SHARD:(r+1)*SHARD of the step's batch


@pytest.fixture(scope="module")
def rt():
    if not hvd.is_initialized():
        hvd.init()
    return hvd


class Tower(torch.nn.Module):
    """depth equal square layers: with small caps each bucket holds one or two of them."""

    def __init__(self, width, depth):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class ManySmall(torch.nn.Module):
    """count tiny layers side by side: 2*count gradient tensors of 4 or 16 elements, all nonzero."""

    def __init__(self, count, width=4):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(count))

    def forward(self, x):
        return sum(torch.tanh(layer(x)) for layer in self.layers)


def build(kind):
    torch.manual_seed(11)                      # the same start on every rank and in the reference
    if kind == "tower":
        model, width = Tower(width=48, depth=5), 48        # 5 x 18.8 KB of float64 parameters
    elif kind == "over_default_caps":
        model, width = Tower(width=1450, depth=2), 1450    # 33.7 MB: > first bucket (1 MB) + one 25 MB bucket
    elif kind == "large_together":
        model, width = Tower(width=400, depth=3), 400      # 3 x 1.3 MB weights: large gradients, one bucket
    else:
        model, width = ManySmall(300), 4                   # 600 tensors
    return model.double(), width


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.5),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
}


def step_data(n, width, steps):
    generator = torch.Generator().manual_seed(5)
    return [(torch.randn(n * SHARD, width, generator=generator, dtype=torch.float64),
             torch.randn(n * SHARD, width, generator=generator, dtype=torch.float64)) for _ in range(steps)]


def train_reference(kind, optimizer, data):
    model, _ = build(kind)
    opt = OPTIMIZERS[optimizer](model.parameters())
    for x, y in data:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model


# How a step clears gradients. After step 1 a bucket's gradients are views of its buffer; whatever the user does to
# them (the optimizer's zero_grad keeps the views, the model's sets them to None, or new tensors replace them) the
# step must reduce this step's gradients only.
ZEROING = {
    "optimizer": lambda model, opt: opt.zero_grad(),
    "optimizer_keep": lambda model, opt: opt.zero_grad(set_to_none=False),
    "model": lambda model, opt: model.zero_grad(),
    "replaced": lambda model, opt: [setattr(p, "grad", torch.zeros_like(p)) for p in model.parameters()],
}


def train_distributed(rt, kind, optimizer, data, zeroing="optimizer", **options):
    model, _ = build(kind)
    opt = rt.DistributedOptimizer(OPTIMIZERS[optimizer](model.parameters()),
                                  named_parameters=model.named_parameters(), **options)
    rt.broadcast_parameters(model.state_dict(), root_rank=0)
    lo, hi = rt.rank() * SHARD, (rt.rank() + 1) * SHARD
    for x, y in data:                          # distinct rows on every rank
        ZEROING[zeroing](model, opt)
        torch.nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi]).backward()
        opt.step()
    return model


def check_against_reference(rt, kind, optimizer, steps, rtol, zeroing="optimizer", **options):
    _, width = build(kind)
    data = step_data(rt.size(), width, steps)
    model = train_distributed(rt, kind, optimizer, data, zeroing, **options)
    reference = train_reference(kind, optimizer, data)
    start, _ = build(kind)
    moved = max((q - s).abs().max().item() for q, s in zip(reference.parameters(), start.parameters()))
    assert moved > 1e-3, f"training barely moved the model ({moved}): the comparison below would be vacuous"
    wrong = []
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        if not torch.allclose(got, want, rtol=rtol, atol=rtol * 1e-2):
            wrong.append(f"{name} (max |diff| {(got - want).abs().max().item():.3g})")
    assert not wrong, (f"{kind}/{optimizer} on {rt.size()} ranks differs from one process on the concatenated "
                       f"batch in {len(wrong)} parameters: {', '.join(wrong[:6])}")


# SGD's update is linear in the gradient, so a tight tolerance catches any scale error; Adam normalises scale away
# but catches a gradient landing in the wrong tensor or bucket.
# Both schedules: overlap (buckets submitted from hooks during backward; step 1 watches the order, later steps hook
# each bucket's last gradient only) and after backward (step() reduces every bucket on the caller's thread).
SCHEDULES = pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "after_backward"])


@SCHEDULES
@pytest.mark.parametrize("optimizer,rtol", [("sgd", 1e-10), ("adam", 1e-8)])
def test_several_small_buckets_match_one_process(rt, optimizer, rtol, overlap):
    # caps of 20 KB / 40 KB over 5 layers of 18.8 KB: the optimizer cuts the model into 3-4 buckets
    check_against_reference(rt, "tower", optimizer, steps=3, rtol=rtol, first_bucket_mb=0.02, bucket_cap_mb=0.04,
                            overlap=overlap)


@SCHEDULES
def test_model_over_the_default_caps_matches_one_process(rt, overlap):
    # 2 x 16.8 MB weights travel alone (in place), the biases in a flat bucket
    check_against_reference(rt, "over_default_caps", "sgd", steps=2, rtol=1e-10, overlap=overlap)


@SCHEDULES
@pytest.mark.parametrize("zeroing", ["optimizer", "model"])
def test_large_gradients_sharing_a_bucket_match_one_process(rt, zeroing, overlap):
    # after backward the three 1.3 MB weights share one bucket, refilled by one copy each step (with overlap each
    # travels alone), the biases another
    check_against_reference(rt, "large_together", "sgd", steps=3, rtol=1e-10, zeroing=zeroing, overlap=overlap)


@SCHEDULES
@pytest.mark.parametrize("optimizer,rtol", [("sgd", 1e-10), ("adam", 1e-8)])
def test_hundreds_of_small_tensors_match_one_process(rt, optimizer, rtol, overlap):
    check_against_reference(rt, "many_small", optimizer, steps=3, rtol=rtol, overlap=overlap)


@SCHEDULES
def test_hundreds_of_small_tensors_in_many_buckets_match_one_process(rt, overlap):
    # 1 KB buckets: about 100 buckets of a few tensors each (with overlap, submitted while backward still runs)
    check_against_reference(rt, "many_small", "sgd", steps=3, rtol=1e-10, first_bucket_mb=0.0005,
                            bucket_cap_mb=0.001, overlap=overlap)


@SCHEDULES
@pytest.mark.parametrize("zeroing", ["optimizer_keep", "model", "replaced"])
def test_gradients_cleared_any_way_match_one_process(rt, zeroing, overlap):
    check_against_reference(rt, "tower", "sgd", steps=4, rtol=1e-10, zeroing=zeroing, first_bucket_mb=0.02,
                            bucket_cap_mb=0.04, overlap=overlap)


def test_ranks_agree_on_one_schedule(rt):
    # rank 0 asks for overlap, the others for after-backward: all must run one schedule (the one every rank can)
    wanted = rt.rank() == 0
    model, _ = build("tower")
    opt = rt.DistributedOptimizer(OPTIMIZERS["sgd"](model.parameters()), named_parameters=model.named_parameters(),
                                  overlap=wanted)
    assert opt.overlaps_backward is False
    check_against_reference(rt, "tower", "sgd", steps=2, rtol=1e-10, first_bucket_mb=0.02, bucket_cap_mb=0.04,
                            overlap=wanted)
