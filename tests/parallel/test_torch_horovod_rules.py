"""horovod.torch 0.28.1's rules where they are easy to get subtly wrong, each against a numpy reference of Horovod's
rule: prescale of integer and float16 tensors (Horovod scales integers in float64 and float16 in float32 on the CPU,
casting back -- integers truncated -- before the sum), broadcast_optimizer_state with parameters that have no
state, and the wrapped optimizer's `_parameter_names`."""
import numpy as np
import pytest
import torch

import ringtrain.torch as hvd

INT_TYPES = [torch.int32, torch.int64]
DTYPES = INT_TYPES + [torch.float16, torch.float32, torch.float64]


def horovod_scaled(x, factor, dtype):
    """Horovod's prescale on the CPU: integers in float64 (truncated back), float16 in float32, others in their own
    dtype; x is a numpy array of dtype's values."""
    if dtype in INT_TYPES:
        return np.trunc(x.astype(np.float64) * np.float64(factor)).astype(x.dtype)
    if dtype == torch.float16:
        return (x.astype(np.float32) * np.float32(factor)).astype(np.float16)
    return x * x.dtype.type(factor)


def rank_values(rank, shape, dtype):
    rng = np.random.default_rng(1234 + rank)
    values = rng.integers(-100, 100, size=shape)
    return values.astype(torch.empty(0, dtype=dtype).numpy().dtype)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
def test_allreduce_prescale_follows_horovods_rule(dtype):
    n, r = hvd.size(), hvd.rank()
    factor = 0.3711
    shape = (17, 17)
    if dtype == torch.float16:
        # Horovod's test: the same tensor on every rank, so the exact sum is n * fp16(fp32(factor) * x); summing
        # in float16 rounds once at 2 and 3 ranks, and at most once more per further rank
        mine = torch.from_numpy(rank_values(0, shape, dtype))
        got = hvd.allreduce(mine, op=hvd.Sum, prescale_factor=factor, name=f"rules.prescale.{dtype}").numpy()
        exact = n * horovod_scaled(mine.numpy(), factor, dtype).astype(np.float32)
        ulps = 1 if n <= 3 else n - 2
        np.testing.assert_allclose(got.astype(np.float32), exact, rtol=ulps * 2.0 ** -10, atol=0)
        return
    scaled = [horovod_scaled(rank_values(k, shape, dtype), factor, dtype) for k in range(n)]
    got = hvd.allreduce(torch.from_numpy(rank_values(r, shape, dtype)), op=hvd.Sum, prescale_factor=factor,
                        name=f"rules.prescale.{dtype}").numpy()
    expected = np.sum(scaled, axis=0, dtype=scaled[0].dtype)
    np.testing.assert_array_equal(got, expected)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", INT_TYPES, ids=lambda d: str(d).split(".")[1])
@pytest.mark.parametrize("grouped", [False, True])
def test_reducescatter_prescale_on_integers_truncates_before_the_sum(dtype, grouped):
    n, r = hvd.size(), hvd.rank()
    factor = 0.45
    rows = 2 * n + 1
    scaled_total = np.sum([horovod_scaled(rank_values(k, (rows, 3), dtype), factor, dtype) for k in range(n)],
                          axis=0)
    sizes = [rows // n + (1 if k < rows % n else 0) for k in range(n)]
    start = sum(sizes[:r])
    expected = scaled_total[start:start + sizes[r]]
    mine = torch.from_numpy(rank_values(r, (rows, 3), dtype))
    if grouped:
        got = hvd.grouped_reducescatter([mine], op=hvd.Sum, prescale_factor=factor,
                                        name=f"rules.rs.g.{dtype}")[0].numpy()
    else:
        got = hvd.reducescatter(mine, op=hvd.Sum, prescale_factor=factor, name=f"rules.rs.{dtype}").numpy()
    np.testing.assert_array_equal(got, expected)


@pytest.mark.mpi(min_size=2)
def test_wrapped_optimizer_has_horovods_parameter_names():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    names = optimizer._parameter_names
    assert names == {p: name for name, p in model.named_parameters()}
    unnamed = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert sorted(unnamed._parameter_names.values()) == sorted(
        f"allreduce.noname.{i}" for i in range(len(list(model.parameters()))))


class _ModelNoGrad(torch.nn.Module):
    """Horovod's test model: an integer parameter without gradient beside a float one."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor([1, 3], dtype=torch.int32), requires_grad=False)
        self.b = torch.nn.Parameter(torch.rand(4))
        self.unused = torch.nn.Parameter(torch.rand(2))

    def forward(self, x):
        return torch.index_select(self.b, 0, self.a.long()) * x


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("optimizer_class, options", [(torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
                                                      (torch.optim.SGD, dict(lr=0.1)),
                                                      (torch.optim.Adam, dict(lr=0.1))],
                         ids=["sgd_momentum", "sgd", "adam"])
def test_broadcast_optimizer_state_with_parameters_without_state(optimizer_class, options):
    torch.manual_seed(hvd.rank())
    model = _ModelNoGrad()
    optimizer = optimizer_class(model.parameters(), **options)
    optimizer.zero_grad()
    model(torch.ones(2)).sum().backward()
    optimizer.step()
    root_state = {k: {kk: vv.clone() if torch.is_tensor(vv) else vv for kk, vv in v.items()}
                  for k, v in optimizer.state_dict()["state"].items()}
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    everyone = hvd.allgather_object(root_state, name="rules.bos." + optimizer_class.__name__ + str(len(options)))
    state = optimizer.state_dict()["state"]
    assert sorted(state) == sorted(everyone[0])
    for key, values in everyone[0].items():
        for item, value in values.items():
            np.testing.assert_array_equal(np.asarray(state[key][item]), np.asarray(value))


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_distributed_optimizer_on_a_rank_outside_its_process_set_trains_alone():
    """Horovod builds it there and that rank's step reduces nothing; the members average among themselves. The next
    collective on the whole world works."""
    n, r = hvd.size(), hvd.rank()
    members = list(range(n - 1))
    process_set = hvd.add_process_set(members)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1, bias=False)
        x = torch.full((1, 3), float(r + 1))
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                             named_parameters=model.named_parameters(), process_set=process_set)
        start = model.weight.detach().clone()
        for _ in range(2):
            optimizer.zero_grad()
            model(x).sum().backward()
            optimizer.step()
        # d(sum(w . x))/dw = x: the members average their x, the outsider uses its own
        grad = np.mean([k + 1.0 for k in members]) if r in members else r + 1.0
        np.testing.assert_allclose(model.weight.detach().numpy(), start.numpy() - 2 * 0.1 * grad, rtol=1e-6)
        assert optimizer._parameter_names == {model.weight: "weight"}
        with optimizer.skip_synchronize():
            optimizer.synchronize()
    finally:
        hvd.remove_process_set(process_set)
    for k in range(3):
        total = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum, name=f"rules.outside.after.{k}")
        assert total.item() == sum(range(n))
