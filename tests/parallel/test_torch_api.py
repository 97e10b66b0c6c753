"""The rest of horovod.torch's API on N ranks, each against a numpy / single-process reference: 16-bit integer
dtypes, Horovod's signatures (reducescatter's name/op order, join(device), barrier(process_set)), 16-bit and integer
scaling, broadcast_parameters/optimizer_state forms, the optimizer's set_backward_passes_per_step, load_state_dict,
groups, sparse gradients, Adasum where it does not apply, the build
queries, HorovodInternalError and the run-time timeline."""
import os
import tempfile

import numpy as np
import pytest
import torch

import ringtrain.torch as hvd
from ringtrain.timeline import load_events


def rank_values(rank, n=6, dtype=torch.int16):
    return (torch.arange(n, dtype=torch.int64) * 3 + rank).to(dtype)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [torch.int16, torch.uint16])
def test_16_bit_integers(dtype):
    n, r = hvd.size(), hvd.rank()
    got = hvd.allreduce(rank_values(r, dtype=dtype), op=hvd.Sum)
    assert got.dtype == dtype
    want = sum(rank_values(s).numpy().astype(np.int64) for s in range(n))
    np.testing.assert_array_equal(got.numpy().astype(np.int64), want)
    np.testing.assert_array_equal(hvd.allreduce(rank_values(r, dtype=dtype), op=hvd.Max).numpy(),
                                  rank_values(n - 1, dtype=dtype).numpy())
    np.testing.assert_array_equal(hvd.broadcast(rank_values(r, dtype=dtype), root_rank=n - 1).numpy(),
                                  rank_values(n - 1, dtype=dtype).numpy())
    gathered = hvd.allgather(rank_values(r, 2, dtype))
    np.testing.assert_array_equal(gathered.numpy(), np.concatenate([rank_values(s, 2).numpy() for s in range(n)]))


@pytest.mark.mpi(min_size=2)
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.int64])
def test_integer_average_rounds_toward_zero_as_horovod(dtype):
    """Rank 0 holds the values, the others zeros: Average is value / size rounded toward zero (-75 / 2 = -37;
    numpy's floor division would give -38)."""
    values = [-75, -1, 75, 1, -5, -100]
    mine = torch.tensor(values if hvd.rank() == 0 else [0] * len(values), dtype=dtype)
    want = torch.tensor([int(v / hvd.size()) for v in values], dtype=dtype)
    assert torch.equal(hvd.allreduce(mine, op=hvd.Average, name=f"trunc.{dtype}"), want)
    grouped = hvd.grouped_allreduce([mine, mine[:2]], op=hvd.Average, name=f"trunc.grouped.{dtype}")
    assert torch.equal(grouped[0], want) and torch.equal(grouped[1], want[:2])


def test_reducescatter_takes_name_then_op():
    n, r = hvd.size(), hvd.rank()
    x = torch.arange(n * 2, dtype=torch.float64).reshape(n, 2) + r
    got = hvd.reducescatter(x, "api.rs.positional_name", hvd.Compression.none, hvd.Sum)
    full = sum(torch.arange(n * 2, dtype=torch.float64).reshape(n, 2) + s for s in range(n))
    torch.testing.assert_close(got, full[r:r + 1])
    handle = hvd.reducescatter_async(x, "api.rs.async", hvd.Max)
    torch.testing.assert_close(hvd.synchronize(handle), x[r:r + 1] - r + n - 1)
    blocks = hvd.synchronize(hvd.grouped_reducescatter_async([x, x[:, :1].contiguous()], "api.grs", hvd.Sum))
    torch.testing.assert_close(blocks[0], full[r:r + 1])
    gathered = hvd.synchronize(hvd.grouped_allgather_async([x[:1]], "api.gag"))
    torch.testing.assert_close(gathered[0], torch.cat([x[:1] - r + s for s in range(n)]))


@pytest.mark.mpi(min_size=2)
def test_join_device_and_barrier_process_set():
    last = hvd.join(device=-1)
    assert isinstance(last, int) and 0 <= last < hvd.size()
    assert len(set(hvd.allgather_object(last))) == 1
    hvd.barrier(process_set=hvd.global_process_set)


@pytest.mark.mpi(min_size=2)
def test_prescale_of_float16_is_computed_in_float32():
    n = hvd.size()
    x = torch.linspace(-3, 3, 50, dtype=torch.float64).to(torch.float16)       # the same on every rank
    got = hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.3)
    scaled = (x.float() * torch.tensor(0.3, dtype=torch.float32)).half()          # fp16(factor * x), once
    if n == 2:      # a sum of two equal halves is exact: Horovod's property, bit for bit
        assert torch.equal(got, scaled * 2)
    else:
        torch.testing.assert_close(got.float(), scaled.float() * n, rtol=2e-3, atol=2e-3)
    avg = hvd.allreduce(x, op=hvd.Average, postscale_factor=0.3)
    torch.testing.assert_close(avg.float(), (x.float() * 0.3), rtol=2e-3, atol=2e-3)
    ints = torch.tensor([1, 3, 5, 100], dtype=torch.int32)
    got = hvd.allreduce(ints, op=hvd.Sum, prescale_factor=1.5)          # integers scale in float64, truncating
    assert got.tolist() == [n * int(v * 1.5) for v in [1, 3, 5, 100]]


@pytest.mark.mpi(min_size=2)
def test_broadcast_parameters_forms_and_optimizer_state_with_model():
    r, root = hvd.rank(), hvd.size() - 1
    a, b = torch.full((3,), float(r)), torch.full((2, 2), 10.0 + r)
    hvd.broadcast_parameters([("a", a), ("b", b)], root_rank=root)          # a plain list of pairs
    assert (a == root).all() and (b == 10 + root).all()
    c = torch.full((2,), float(r))
    hvd.broadcast_parameters([c], root_rank=0)                                 # bare tensors, as Horovod allows
    assert (c == 0).all()
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * (r + 1), momentum=0.5)
    hvd.broadcast_optimizer_state(opt, root_rank=root, model=model)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * (root + 1))


def _model():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()


def _data(rank, k=0):
    g = torch.Generator().manual_seed(1000 * k + rank)
    return torch.randn(5, 3, generator=g, dtype=torch.float64)


def _reference_grads(passes):
    """Gradients one process gets by averaging every rank's `passes` accumulated backward passes."""
    model = _model()
    total = [torch.zeros_like(p) for p in model.parameters()]
    for s in range(hvd.size()):
        model.zero_grad()
        for k in range(passes):
            model(_data(s, k)).pow(2).sum().backward()
        total = [t + p.grad for t, p in zip(total, model.parameters())]
    return [t / hvd.size() for t in total]


@pytest.mark.mpi(min_size=2)
def test_set_backward_passes_per_step_and_load_state_dict_drop_pending():
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=model.named_parameters(), backward_passes_per_step=1)
    opt.set_backward_passes_per_step(2)
    model(_data(hvd.rank(), 5)).pow(2).sum().backward()      # one pass pending (not yet reduced) ...
    opt.load_state_dict(opt.state_dict())                    # ... dropped: the count starts over
    opt.zero_grad()
    for k in range(2):
        model(_data(hvd.rank(), k)).pow(2).sum().backward()   # without the reset, this second pass would be the 3rd
    opt.step()
    for p, want in zip(model.parameters(), _reference_grads(2)):
        torch.testing.assert_close(p.grad, want)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("grouping", ["int", "lists", "num_groups"])
def test_groups_define_the_buckets(grouping):
    model = _model()
    params = list(model.parameters())
    kwargs = {"int": dict(groups=2), "lists": dict(groups=[[params[0], params[3]]]),
              "num_groups": dict(num_groups=3)}[grouping]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=model.named_parameters(), **kwargs)
    expected = {"int": 2, "lists": 3, "num_groups": 3}[grouping]
    for _ in range(2):                           # the layout is the user's: not rebuilt after the first step
        opt.zero_grad()
        model(_data(hvd.rank())).pow(2).sum().backward()
        opt.step()
        assert len(opt._ringtrain.reducer.buckets) == expected
        if grouping == "lists":
            assert any({id(p) for p in b.keys} == {id(params[0]), id(params[3])}
                       for b in opt._ringtrain.reducer.buckets)
    for p, want in zip(model.parameters(), _reference_grads(1)):
        torch.testing.assert_close(p.grad, want)


def _embedding_inputs(rank):
    return torch.tensor([rank % 5, (rank * 3 + 1) % 5, 2])


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_sparse_embedding_gradients(sparse_as_dense):
    n = hvd.size()
    torch.manual_seed(0)
    emb = torch.nn.Embedding(5, 3, sparse=True).double()
    start = emb.weight.detach().clone()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.5), sparse_as_dense=sparse_as_dense,
                                   named_parameters=emb.named_parameters())
    emb(_embedding_inputs(hvd.rank())).pow(2).sum().backward()
    opt.step()
    assert emb.weight.grad.is_sparse != sparse_as_dense
    reference = torch.nn.Embedding(5, 3).double()
    grads = []
    for s in range(n):
        reference.weight.data.copy_(start)
        reference.zero_grad()
        reference(_embedding_inputs(s)).pow(2).sum().backward()
        grads.append(reference.weight.grad.clone())
    torch.testing.assert_close(emb.weight.detach(), start - 0.5 * sum(grads) / n)

    values = torch.sparse_coo_tensor(torch.tensor([[hvd.rank() % 4]]), torch.tensor([1.0 + hvd.rank()]), (4,))
    summed = hvd.synchronize(hvd.sparse_allreduce_async(values, "api.sparse", hvd.Sum))
    want = torch.zeros(4)
    for s in range(n):
        want[s % 4] += 1.0 + s
    torch.testing.assert_close(summed.to_dense(), want)


@pytest.mark.mpi(min_size=2)
def test_adasum_where_it_does_not_apply_is_a_clear_error():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="op=Adasum takes none of shard"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum, shard="optimizer")
    with pytest.raises(NotImplementedError, match="Adasum applies to allreduce"):
        hvd.reducescatter(torch.ones(2), op=hvd.Adasum)


@pytest.mark.mpi(min_size=2)
def test_queries_and_horovod_internal_error():
    assert hvd.mpi_built() and hvd.mpi_enabled() and hvd.mpi_threads_supported()
    assert not (hvd.gloo_built() or hvd.gloo_enabled() or hvd.ddl_built() or hvd.ccl_built() or hvd.rocm_built())
    assert hvd.nccl_built() in (True, False) and hvd.cuda_built() in (True, False)
    assert hvd.nccl_built() <= hvd.cuda_built()
    assert hvd.is_homogeneous() is True       # one node: every "node" runs all ranks
    with pytest.raises(hvd.HorovodInternalError, match="api.mismatch"):
        hvd.allreduce(torch.ones(2 + hvd.rank()), name="api.mismatch")


@pytest.mark.mpi(min_size=2)
def test_timeline_started_and_stopped_at_run_time():
    path = hvd.broadcast_object(os.path.join(tempfile.mkdtemp(prefix="ringtrain-tl-"), "trace.json"), root_rank=0)
    hvd.start_timeline(path, mark_cycles=True)
    hvd.allreduce(torch.ones(3), name="api.traced")
    hvd.stop_timeline()
    hvd.allreduce(torch.ones(3), name="api.after_stop")
    hvd.barrier()
    if hvd.rank() == 0:
        names = {e.get("args", {}).get("tensor") for e in load_events(path)}
        assert "api.traced" in names and "api.after_stop" not in names
        os.unlink(path)


@pytest.mark.mpi(min_size=2)
def test_async_in_place_forms_and_alltoall_async():
    """Horovod's *_async_ forms write into the tensor they were given, and synchronize(handle) returns it;
    alltoall_async's handle gives (received tensor, received splits), the splits int32 unless a tensor of
    another dtype was passed."""
    n, r = hvd.size(), hvd.rank()
    x = torch.full((3,), float(r + 1))
    handle = hvd.allreduce_async_(x, op=hvd.Sum, name="async_.allreduce")
    assert hvd.synchronize(handle) is x and hvd.poll(handle)
    assert torch.equal(x, torch.full((3,), n * (n + 1) / 2))
    pair = [torch.full((2,), float(r)), torch.arange(4, dtype=torch.int64) * (r + 1)]
    results = hvd.synchronize(hvd.grouped_allreduce_async_(pair, op=hvd.Sum, name="async_.grouped"))
    assert results[0] is pair[0] and results[1] is pair[1]
    assert torch.equal(pair[1], torch.arange(4) * (n * (n + 1) // 2))
    y = torch.full((2, 2), float(r))
    assert hvd.synchronize(hvd.broadcast_async_(y, root_rank=n - 1, name="async_.broadcast")) is y
    assert torch.equal(y, torch.full((2, 2), float(n - 1)))
    rows = torch.arange(2 * n, dtype=torch.float32) + 100 * r          # two rows for every rank
    received, splits = hvd.synchronize(hvd.alltoall_async(rows, name="async_.alltoall"))
    assert splits.dtype == torch.int32 and splits.tolist() == [2] * n
    assert torch.equal(received, torch.cat([torch.arange(2 * r, 2 * r + 2, dtype=torch.float32) + 100 * q
                                            for q in range(n)]))
    _, splits64 = hvd.synchronize(hvd.alltoall_async(rows, splits=torch.tensor([2] * n, dtype=torch.int64),
                                                     name="async_.alltoall.int64"))
    assert splits64.dtype == torch.int64


@pytest.mark.mpi(min_size=2)
def test_sparse_average_in_a_process_set_divides_by_the_sets_size():
    """Average over the set of all ranks but the last: the set's sum over its own size, not over the world's."""
    members = list(range(hvd.size() - 1))
    subset = hvd.add_process_set(members)
    try:
        if subset.included():
            values = torch.sparse_coo_tensor(torch.tensor([[hvd.rank()]]), torch.tensor([2.0 + hvd.rank()]),
                                             (hvd.size(),))
            got = hvd.synchronize(hvd.sparse_allreduce_async(values, "api.sparse.set", hvd.Average,
                                                             process_set=subset))
            want = torch.tensor([2.0 + r if r in members else 0.0 for r in range(hvd.size())]) / len(members)
            torch.testing.assert_close(got.to_dense(), want)
    finally:
        hvd.remove_process_set(subset)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("inplace", ["allreduce_", "grouped_allreduce_"])
def test_in_place_allreduce_of_a_non_contiguous_tensor_writes_the_tensor(inplace):
    n = hvd.size()
    base = torch.arange(12.0).reshape(3, 4) * (hvd.rank() + 1)
    view = base.t()                                   # non-contiguous: the allreduce runs on a contiguous copy
    assert not view.is_contiguous()
    want = torch.arange(12.0).reshape(3, 4).t() * sum(r + 1 for r in range(n))
    if inplace == "allreduce_":
        out = hvd.allreduce_(view, op=hvd.Sum, name="api.noncontig")
    else:
        (out,) = hvd.grouped_allreduce_([view], op=hvd.Sum, name="api.noncontig.grouped")
    assert out is view
    torch.testing.assert_close(view, want)
    torch.testing.assert_close(base, want.t())
