"""DistributedOptimizer on N ranks, each on its shard, must equal one process on the concatenated batch.

Every rank also computes the one-process reference itself (all data is generated from fixed seeds), so the check
needs no communication beyond what is under test.
"""
import time

import numpy as np
import pytest
import torch

import ringtrain.torch as hvd
from ringtrain.errors import TensorMismatchError

STEPS = 10
SHARD = 4           # rows per rank per backward pass


@pytest.fixture(scope="module")
def rt():
    if not hvd.is_initialized():
        hvd.init()
    return hvd


def make_model(seed=0, hidden=8, dtype=torch.float64):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 3)).to(dtype)


def batches(size, passes, dtype=torch.float64):
    """batches[step][pass] = (x, y) of size*SHARD rows; rank r's shard is rows r*SHARD:(r+1)*SHARD."""
    generator = torch.Generator().manual_seed(1234)
    return [[(torch.randn(size * SHARD, 6, generator=generator, dtype=dtype),
              torch.randn(size * SHARD, 3, generator=generator, dtype=dtype)) for _ in range(passes)]
            for _ in range(STEPS)]


def train_reference(make_optimizer, data, dtype=torch.float64):
    model = make_model(dtype=dtype)
    opt = make_optimizer(model.parameters())
    for step in data:
        opt.zero_grad()
        for x, y in step:                       # k passes accumulate, as on the ranks
            torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model


def train_distributed(rt, make_optimizer, data, dtype=torch.float64, **options):
    model = make_model(seed=100 + rt.rank(), dtype=dtype)      # different start: broadcast must fix it
    opt = rt.DistributedOptimizer(make_optimizer(model.parameters()), named_parameters=model.named_parameters(),
                                  backward_passes_per_step=len(data[0]), **options)
    reference_start = make_model(dtype=dtype).state_dict() if rt.rank() == 0 else model.state_dict()
    model.load_state_dict(reference_start)
    rt.broadcast_parameters(model.state_dict(), root_rank=0)
    rt.broadcast_optimizer_state(opt, root_rank=0)
    lo, hi = rt.rank() * SHARD, (rt.rank() + 1) * SHARD
    for step in data:
        opt.zero_grad()
        for x, y in step:
            torch.nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi]).backward()
        opt.step()
    return model, opt


def assert_same_on_all_ranks(rt, model, name):
    flat = torch.cat([p.detach().reshape(-1).double() for p in model.state_dict().values()])
    everyone = rt.allgather_object(flat.numpy(), name=name)
    for r, other in enumerate(everyone):
        np.testing.assert_array_equal(other, everyone[0], err_msg=f"rank {r} differs from rank 0")


OPTIMIZERS = {
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
}


SCHEDULES = pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "after_backward"])


@pytest.mark.mpi(min_size=2)
@SCHEDULES
@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_n_ranks_equal_one_process_on_concatenated_batch(rt, optimizer, passes, overlap):
    data = batches(rt.size(), passes)
    model, _ = train_distributed(rt, OPTIMIZERS[optimizer], data, overlap=overlap)
    reference = train_reference(OPTIMIZERS[optimizer], data)
    moved = sum((p - q).abs().max().item() for p, q in zip(reference.parameters(), make_model().parameters()))
    assert moved > 0.05      # training really changed the model, so equality below is not trivial
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-9, msg=lambda m: f"{name}: {m}")
    assert_same_on_all_ranks(rt, model, f"check.{optimizer}.{passes}.{overlap}")


@pytest.mark.mpi(min_size=2)
@SCHEDULES
def test_cpu_gradients_live_in_the_shm_window_and_match_reference(rt, overlap):
    """After the first step every CPU .grad -- a 1.4 MB one with a bucket of its own included -- is a view of a
    buffer in the shm window (reduced with no copy-in or copy-out), and training still equals one process."""
    from ringtrain.core import state

    def make():
        torch.manual_seed(7)
        return torch.nn.Sequential(torch.nn.Linear(600, 300), torch.nn.Tanh(), torch.nn.Linear(300, 3)).double()

    generator = torch.Generator().manual_seed(99)
    data = [(torch.randn(rt.size() * SHARD, 600, generator=generator, dtype=torch.float64),
             torch.randn(rt.size() * SHARD, 3, generator=generator, dtype=torch.float64)) for _ in range(3)]
    reference = make()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    model = make()
    opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  named_parameters=model.named_parameters(), overlap=overlap)
    lo, hi = rt.rank() * SHARD, (rt.rank() + 1) * SHARD
    for x, y in data:
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi]).backward()
        opt.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-9, msg=lambda m: f"{name}: {m}")
    transport = state.engine().transports["cpu"]
    if transport.name == "shm":
        outside = [name for name, p in model.named_parameters()
                   if transport._offset_in_region(p.grad.detach().numpy()) is None]
        assert not outside, f"rank {rt.rank()}: gradients outside the shm window: {outside}"


@pytest.mark.mpi(min_size=2)
@SCHEDULES
@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("refill", ["every bucket", "every tensor alone", "no bucket"])
def test_refilled_buckets_train_as_views_do(rt, refill, passes, overlap):
    """A bucket refilled by a copy every step (its gradients dropped by zero_grad) and one whose gradients stay
    views of it (zeroed, added to) both equal one process; the refilled gradients are views after step() and gone
    after zero_grad(), the others views throughout. Only after backward: with overlap every bucket keeps views.
    A refilled bucket of one gradient is reduced from the fresh gradient straight into the bucket."""
    data = batches(rt.size(), passes)
    make = OPTIMIZERS["sgd_momentum"]
    model = make_model(dtype=torch.float64)
    alone = [[p] for p in model.parameters()] if refill == "every tensor alone" else None
    opt = rt.DistributedOptimizer(make(model.parameters()), named_parameters=model.named_parameters(),
                                  backward_passes_per_step=passes, overlap=overlap, groups=alone)
    opt._ringtrain.refill_min_tensor_bytes = 0 if refill != "no bucket" else float("inf")
    lo, hi = rt.rank() * SHARD, (rt.rank() + 1) * SHARD
    for number, step in enumerate(data):
        opt.zero_grad()
        grads = [p.grad for p in model.parameters()]
        if number >= 2:       # buckets have views from the first step on, re-planned ones (overlap) from the second
            assert all(g is None for g in grads) if refill != "no bucket" and not overlap else all(
                g is not None and not g.any() for g in grads)
        for x, y in step:
            torch.nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi]).backward()
        opt.step()
    reference = train_reference(make, data)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-9, msg=lambda m: f"{name}: {m}")
    buffers = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(buffers) == len(opt._ringtrain.reducer.buckets)        # every gradient is a view of its bucket


class LargeTogether(torch.nn.Module):
    """Three weights of 120 KB and their biases (float64): refilled, one bucket of several gradients past the
    one-barrier size. `unused` gets no gradient; `transposed` lays one weight out transposed, so its gradient
    follows (not contiguous)."""

    def __init__(self, transposed):
        super().__init__()
        torch.manual_seed(3)
        self.a, self.b = torch.nn.Linear(6, 2500), torch.nn.Linear(2500, 6)
        self.unused = torch.nn.Linear(2500, 6)
        if transposed:
            self.b.weight = torch.nn.Parameter(self.b.weight.detach().t().contiguous().t())
        self.double()

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))[:, :3]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_a_refilled_bucket_of_several_gradients_is_reduced_from_where_they_lie(rt, layout, passes):
    """After backward, a refilled bucket of several fresh gradients (one parameter without a gradient among them)
    is reduced from them straight into the bucket's views -- one grouped allreduce, no packing copy -- and equals
    one process; a gradient that is not contiguous makes the bucket packed as before, with the same result. (How
    the transport reads the group is test_grouped_express's: in a long job the engine's name cache may be full,
    and a new optimizer's buckets then take the general path, which packs.)"""
    transposed = layout == "transposed"
    data = [[(x[:, :6].contiguous(), y) for x, y in step] for step in batches(rt.size(), passes)]
    model = LargeTogether(transposed)
    opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                  named_parameters=model.named_parameters(), backward_passes_per_step=passes,
                                  overlap=False)
    hooks = opt._ringtrain
    hooks.refill_min_tensor_bytes = 0
    packed = []
    into_buffer = hooks._into_buffer
    hooks._into_buffer = lambda bucket, grads: packed.append(bucket.name) or into_buffer(bucket, grads)
    lo, hi = rt.rank() * SHARD, (rt.rank() + 1) * SHARD
    for step in data:
        opt.zero_grad()
        for x, y in step:
            torch.nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi]).backward()
        if transposed:
            assert not model.b.weight.grad.is_contiguous()
        opt.step()
    reference = LargeTogether(transposed)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.01, momentum=0.9)
    for step in data:
        ref_opt.zero_grad()
        for x, y in step:
            torch.nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-9, msg=lambda m: f"{name}: {m}")
    assert not model.unused.weight.grad.any()
    (bucket,) = hooks.reducer.buckets
    assert all(p.grad is view for p, view in zip(bucket.keys, bucket.views))
    assert len(packed) == (STEPS if transposed else 0), packed


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_compressed_gradients_stay_close_to_reference(rt, compression):
    data = batches(rt.size(), 1, dtype=torch.float32)
    make = OPTIMIZERS["sgd_momentum"]
    model, _ = train_distributed(rt, make, data, dtype=torch.float32,
                                 compression=getattr(rt.Compression, compression))
    reference = train_reference(make, data, dtype=torch.float32)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0.05, atol=0.02)
    assert_same_on_all_ranks(rt, model, f"check.{compression}")


@pytest.mark.mpi(min_size=2)
def test_gradient_predivide_factor_gives_the_same_average(rt):
    data = batches(rt.size(), 1)
    make = OPTIMIZERS["sgd_momentum"]
    model, _ = train_distributed(rt, make, data, gradient_predivide_factor=float(rt.size()))
    reference = train_reference(make, data)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-9)


@pytest.mark.mpi(min_size=2)
@SCHEDULES
def test_op_sum_adds_the_gradients_of_all_ranks(rt, overlap):
    """op=Sum: the step uses the sum of the ranks' gradients, i.e. size times the average; SGD with lr / size on
    the sum equals one process with lr on the concatenated batch."""
    n = rt.size()
    data = batches(n, 1)
    model, _ = train_distributed(rt, lambda params: torch.optim.SGD(params, lr=0.1 / n, momentum=0.9), data,
                                 op=rt.Sum, overlap=overlap)
    reference = train_reference(OPTIMIZERS["sgd_momentum"], data)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-9, msg=lambda m: f"{name}: {m}")


class TwoBranches(torch.nn.Module):
    """Two parallel layers whose outputs are added. Autograd runs the branch computed last first, so a rank that
    computes them in the other order sees its gradients become final in another order."""
    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.a, self.b = torch.nn.Linear(6, 3).double(), torch.nn.Linear(6, 3).double()

    def forward(self, x, a_first):
        outs = [self.a(x), self.b(x)] if a_first else [self.b(x), self.a(x)]
        return outs[0] + outs[1]


@pytest.mark.mpi(min_size=2)
def test_ready_orders_differ_across_ranks_and_layouts_still_agree(rt):
    """Each bucket holds one parameter; rank 0 sees branch b's gradients first, rank 1 branch a's. After step 1 the
    buckets are re-laid in ONE order (rank 0's) on every rank; the result equals one process."""
    data = batches(rt.size(), 1)
    model, reference = TwoBranches(), TwoBranches()
    opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(), first_bucket_mb=1e-6,
                                  bucket_cap_mb=1e-6, overlap=True)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    lo, hi = rt.rank() * SHARD, (rt.rank() + 1) * SHARD
    for step in data:
        x, y = step[0]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[lo:hi], a_first=rt.rank() % 2 == 0), y[lo:hi]).backward()
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(reference(x, a_first=True), y).backward()
        ref_opt.step()
    layout = [[opt._ringtrain.reducer.name_of(p) for p in bucket.keys] for bucket in opt._ringtrain.reducer.buckets]
    assert rt.allgather_object(layout, name="check.two_branches.layout") == [layout] * rt.size()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-9, msg=lambda m: f"{name}: {m}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("root", ["first", "last"])
def test_broadcast_optimizer_state_of_stepped_and_lazy_adam(rt, root):
    root = 0 if root == "first" else rt.size() - 1
    model = make_model(seed=7)
    rt.broadcast_parameters(model.named_parameters(), root_rank=0)
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (rt.rank() + 1))
    if rt.rank() == root:                  # only the root has state; the others' Adam state does not exist yet
        model(torch.ones(2, 6, dtype=torch.float64)).sum().backward()
        opt.step()
    # the root's own state, sent another way (pickled): every rank must end with exactly this
    want = rt.broadcast_object(opt.state_dict() if rt.rank() == root else None, root_rank=root,
                               name=f"check.adam_state.want.{root}")
    rt.broadcast_optimizer_state(opt, root_rank=root)
    state = opt.state_dict()
    everyone = rt.allgather_object(state, name=f"check.adam_state.{root}")
    assert want["param_groups"][0]["lr"] == 0.01 * (root + 1)
    for r, other in enumerate(everyone):
        assert other["param_groups"] == want["param_groups"], f"rank {r}"
        assert sorted(other["state"]) == sorted(want["state"]) == [0, 1, 2, 3]
        for index, entry in want["state"].items():
            for key, value in entry.items():
                torch.testing.assert_close(other["state"][index][key], value, rtol=0, atol=0,
                                           msg=lambda m: f"rank {r}, state {index}.{key}: {m}")
    # all lazy: nobody has state, everyone ends with none and root's hyper-parameters
    fresh = torch.optim.Adam(model.parameters(), lr=0.5 + rt.rank())
    rt.broadcast_optimizer_state(fresh, root_rank=1)
    assert fresh.state_dict()["state"] == {} and fresh.param_groups[0]["lr"] == 1.5


class ScaleThenHeavy(torch.nn.Module):
    """A per-feature scale at the input, a slow parameter-free block, then a Linear: in backward the Linear's two
    gradients become final, then the slow block runs for milliseconds, then the scale's gradient. All three share
    one bucket, so the bucket must not go out before the scale's gradient is in."""
    def __init__(self):
        super().__init__()
        torch.manual_seed(11)
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 6, dtype=torch.float64))
        self.register_buffer("mixing", torch.randn(6, 6, dtype=torch.float64) / 3)
        self.out = torch.nn.Linear(6, 3).double()

    def forward(self, x):
        h = x * self.scale
        for _ in range(400):                 # slow in backward, no parameters
            h = torch.tanh(h @ self.mixing) + h
        return self.out(h)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("passes", [1, 2])
def test_bucket_goes_out_only_after_its_last_gradient(rt, passes):
    data = batches(rt.size(), passes)
    model, reference = ScaleThenHeavy(), ScaleThenHeavy()
    opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                  named_parameters=model.named_parameters(), backward_passes_per_step=passes,
                                  overlap=True)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    assert len(opt._ringtrain.reducer.buckets) == 1
    lo, hi = rt.rank() * SHARD, (rt.rank() + 1) * SHARD
    for step in data[:4]:
        opt.zero_grad()
        ref_opt.zero_grad()
        for x, y in step:
            torch.nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi]).backward()
            torch.nn.functional.mse_loss(reference(x), y).backward()
        opt.step()
        ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-9, msg=lambda m: f"{name}: {m}")


class Tower(torch.nn.Module):
    """Several equal layers, so a small first bucket holds only the last ones."""
    def __init__(self, width=64, depth=6):
        super().__init__()
        torch.manual_seed(3)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


@pytest.mark.mpi(min_size=2)
def test_first_allreduce_is_submitted_before_backward_ends(rt):
    model = Tower()
    opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                  named_parameters=model.named_parameters(), first_bucket_mb=0.02, bucket_cap_mb=0.04,
                                  overlap=True)
    first_layer = model.layers[0]
    seen = []

    def last_gradient_hook(param):           # registered after the optimizer's hooks: runs after them
        submitted = [p.handle.times["submitted"] for entries in opt._ringtrain.reducer.pending.values()
                     for p in entries if p.handle is not None]
        seen.append((time.perf_counter(), min(submitted) if submitted else None, len(opt._ringtrain.reducer.buckets)))
    first_layer.weight.register_post_accumulate_grad_hook(last_gradient_hook)
    inputs = [torch.randn(8, 64, generator=torch.Generator().manual_seed(r)) for r in range(rt.size())]
    x = inputs[rt.rank()]                    # distinct rows on every rank
    for _ in range(3):                       # step 1: initial layout; later steps: rebuilt in observed order
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    assert len(seen) == 3 and seen[0][2] > 2
    for hook_time, first_submitted, _ in seen:
        assert first_submitted is not None and first_submitted < hook_time
    assert opt._ringtrain.reducer.buckets[0].name.endswith(".g1.bucket0")           # layout was rebuilt after step 1
    assert all(p is not first_layer.weight for p in opt._ringtrain.reducer.buckets[0].keys)
    assert_same_on_all_ranks(rt, model, "check.tower")
    # one process on all ranks' rows: the mean over ranks of each rank's loss (a bucket reduced with Sum, or
    # scaled wrongly, still agrees across ranks but not with this)
    reference = Tower()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.01)
    for _ in range(3):
        ref_opt.zero_grad()
        (sum(reference(xr).sum() for xr in inputs) / rt.size()).backward()
        ref_opt.step()
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"tower {name}: {m}")


class Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.trunk = torch.nn.Linear(4, 4).double()
        self.rank0_only = torch.nn.Linear(4, 4).double()     # used on rank 0 only
        self.never_used = torch.nn.Linear(4, 4).double()
        self.frozen = torch.nn.Linear(4, 4).double()
        self.frozen.requires_grad_(False)

    def forward(self, x, use_branch):
        h = self.frozen(torch.tanh(self.trunk(x)))
        return (self.rank0_only(h) if use_branch else h).sum(dim=1)


@pytest.mark.mpi(min_size=2)
@SCHEDULES
def test_unused_and_frozen_parameters_do_not_hang_and_match_reference(rt, overlap):
    n = rt.size()
    data = torch.randn(STEPS, n, 3, 4, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    model, reference = Branchy(), Branchy()
    start = {k: v.clone() for k, v in reference.state_dict().items()}
    opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(), overlap=overlap)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(STEPS):
        opt.zero_grad()
        model(data[step, rt.rank()], use_branch=rt.rank() == 0).pow(2).mean().backward()
        opt.step()
        ref_opt.zero_grad()   # one process: the mean over ranks of each rank's loss
        sum(reference(data[step, r], use_branch=r == 0).pow(2).mean() for r in range(n)).div(n).backward()
        ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-9, msg=lambda m: f"{name}: {m}")
    for name in ("never_used.weight", "frozen.weight"):
        torch.testing.assert_close(model.state_dict()[name], start[name], rtol=0, atol=0)
    assert model.frozen.weight.grad is None
    assert not torch.equal(model.rank0_only.weight, start["rank0_only.weight"])
    assert_same_on_all_ranks(rt, model, f"check.branchy.{overlap}")


@pytest.mark.mpi(min_size=2)
def test_model_mismatch_across_ranks_is_an_error_on_every_rank(rt):
    model = make_model(hidden=8 if rt.rank() == 0 else 9)
    with pytest.raises(TensorMismatchError) as error:
        rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                named_parameters=model.named_parameters())
    message = str(error.value)
    assert "'0.weight'" in message and "(8, 6)" in message and "(9, 6)" in message
    assert "ranks [0]" in message and f"ranks {list(range(1, rt.size()))}" in message


@pytest.mark.mpi(min_size=2)
@SCHEDULES
@pytest.mark.parametrize("first_joiner", ["last_rank", "rank0"])
def test_uneven_inputs_with_join(rt, overlap, first_joiner):
    """Rank r has STEPS - 2r batches (first_joiner=last_rank; rank0: STEPS - 2(n-1-r)). After its last one it joins:
    the others' steps then average over the full world size with zeros from the joined ranks (DDP's rule). join()
    returns the last rank to join, the one that saw every step."""
    n = rt.size()
    order = list(range(n)) if first_joiner == "last_rank" else list(reversed(range(n)))
    steps_of = [STEPS - 2 * order[r] for r in range(n)]
    data = batches(n, 1)
    make = OPTIMIZERS["sgd_momentum"]
    model = make_model()
    opt = rt.DistributedOptimizer(make(model.parameters()), named_parameters=model.named_parameters(),
                                  overlap=overlap)
    lo, hi = rt.rank() * SHARD, (rt.rank() + 1) * SHARD
    for step in range(steps_of[rt.rank()]):
        x, y = data[step][0]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi]).backward()
        opt.step()
    last = rt.join()
    assert last == order.index(0)
    rt.broadcast_parameters(model.state_dict(), root_rank=last)

    reference = make_model()
    ref_opt = make(reference.parameters())
    for step in range(STEPS):
        x, y = data[step][0]
        ref_opt.zero_grad()
        active = [r for r in range(n) if step < steps_of[r]]
        loss = sum(torch.nn.functional.mse_loss(reference(x[r * SHARD:(r + 1) * SHARD]), y[r * SHARD:(r + 1) * SHARD])
                   for r in active) / n
        loss.backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-9)
    assert_same_on_all_ranks(rt, model, f"check.join.{overlap}.{first_joiner}")


@pytest.mark.mpi(min_size=2)
def test_check_every_catches_a_diverged_rank_at_step(rt):
    import ringtrain
    from ringtrain.torch.consistency import ParameterDivergenceError
    model = make_model()
    opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters())
    config = ringtrain.config()
    saved, config.check_every = config.check_every, 2
    try:
        x = torch.ones(2, 6, dtype=torch.float64)
        for step in range(2):
            if step == 1 and rt.rank() == rt.size() - 1:
                with torch.no_grad():
                    model[2].bias.add_(1.0)          # this rank silently drifts
            opt.zero_grad()
            model(x).sum().backward()
            if step == 0:
                opt.step()                           # step 1: not a check step
            else:
                with pytest.raises(ParameterDivergenceError, match="2.bias"):
                    opt.step()
    finally:
        config.check_every = saved


class TiedAutoencoder(torch.nn.Module):
    """The decoder reuses the encoder's weight (transposed): one parameter, two uses in the graph."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.encoder = torch.nn.Linear(6, 4).double()
        self.decoder_bias = torch.nn.Parameter(torch.zeros(6, dtype=torch.float64))

    def forward(self, x):
        return torch.nn.functional.linear(torch.tanh(self.encoder(x)), self.encoder.weight.t(), self.decoder_bias)


@pytest.mark.mpi(min_size=2)
@SCHEDULES
def test_parameters_shared_between_modules_match_reference(rt, overlap):
    data = batches(rt.size(), 1)
    reference = TiedAutoencoder()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for [(x, _)] in data:
        opt.zero_grad()
        torch.nn.functional.mse_loss(reference(x), x).backward()
        opt.step()
    model = TiedAutoencoder()
    opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(), overlap=overlap)
    lo, hi = rt.rank() * SHARD, (rt.rank() + 1) * SHARD
    for [(x, _)] in data:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[lo:hi]), x[lo:hi]).backward()
        opt.step()
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12, msg=f"shared-parameter model: {name}")
