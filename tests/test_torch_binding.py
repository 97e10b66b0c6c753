"""Single-process tests of ringtrain.torch: tensor<->array views, compression, bucket layout, and the optimizer on
one rank (where it must behave exactly like the optimizer it wraps)."""
import ml_dtypes
import numpy as np
import pytest
import torch

import ringtrain.torch as hvd
from ringtrain.errors import RingtrainError
from ringtrain.torch import functions
from ringtrain.reducer.reducer import plan_buckets
from ringtrain.torch.gradient_hooks import _describe_model_mismatch, parameter_members


def _layout_buckets(params, *args, **kwargs):
    """The reducer's plan for torch tensors, as lists of the tensors."""
    members = parameter_members(params, {id(p): f"p{i}" for i, p in enumerate(params)})
    return [[m.key for m in bucket] for bucket in plan_buckets(members, *args, **kwargs)]


@pytest.fixture(scope="module")
def rt():
    if not hvd.is_initialized():
        hvd.init()
    return hvd


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64,
                                   torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool])
def test_to_array_shares_memory_and_round_trips(dtype):
    t = (torch.arange(12) % 5).reshape(3, 4).to(dtype)
    a = functions.to_array(t)
    assert a.shape == (3, 4)
    assert a.ctypes.data == t.data_ptr()               # a view, not a copy
    if dtype == torch.bfloat16:
        assert a.dtype == np.dtype(ml_dtypes.bfloat16)
    back = functions.from_array(a)
    assert back.dtype == dtype and back.data_ptr() == t.data_ptr()
    assert torch.equal(back, t)


def test_to_array_of_parameter_writes_through():
    p = torch.nn.Parameter(torch.zeros(4))
    functions.to_array(p)[:] = 7.0
    assert p.detach().tolist() == [7.0] * 4


def test_a_kept_host_view_is_reused_only_while_it_is_true():
    """functions.host_array keeps a contiguous CPU tensor's numpy view; a tensor moved to new memory, viewed as
    another dtype, resized in place, restrided to the same shape or dead never gets the old view."""
    import gc
    from ringtrain.torch import host_views

    def same(t):                # the view host_array returns is t's memory, dtype and shape now
        a = functions.host_array(t)
        assert a.ctypes.data == t.data_ptr() and a.shape == tuple(t.shape), (a.shape, t.shape)
        assert a.dtype == functions.to_array(t).dtype
        return a

    t = torch.arange(16, dtype=torch.float32)
    first = same(t)
    assert functions.host_array(t) is first              # kept: no new view
    t.data = torch.zeros(16)                             # new memory
    assert same(t) is not first
    t.data = t.data.view(torch.int32)                    # the same memory as another dtype (same itemsize)
    assert same(t).dtype == np.int32
    t.resize_(8)                                         # the same memory, fewer elements
    assert same(t).shape == (8,)
    m = torch.arange(16, dtype=torch.float64).reshape(4, 4)
    same(m)
    m.as_strided_((4, 4), (1, 4))                        # the same memory and shape, transposed
    assert host_views.view(m) is None
    np.testing.assert_array_equal(functions.host_array(m), m.numpy())
    key = id(t)
    del t, first
    gc.collect()
    assert key not in host_views._views                  # dropped with its tensor


def test_to_array_rejects_non_tensors():
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        functions.to_array(np.zeros(3))


@pytest.mark.parametrize("compression, wire_dtype, tolerance", [
    (hvd.Compression.none, torch.float32, 0.0),
    (hvd.Compression.fp16, torch.float16, 1e-3),
    (hvd.Compression.bf16, torch.bfloat16, 8e-3),
])
def test_compression_round_trip(compression, wire_dtype, tolerance):
    x = torch.linspace(-3, 3, 101)
    wire, ctx = compression.compress(x)
    assert wire.dtype == wire_dtype
    back = compression.decompress(wire, ctx)
    assert back.dtype == torch.float32
    np.testing.assert_allclose(back.numpy(), x.numpy(), rtol=tolerance, atol=tolerance)


def test_compression_leaves_integers_alone():
    x = torch.arange(5)
    wire, ctx = hvd.Compression.fp16.compress(x)
    assert wire.dtype == torch.int64 and torch.equal(hvd.Compression.fp16.decompress(wire, ctx), x)


def test_bucket_layout_small_first_then_cap_and_split_by_dtype():
    kb = lambda n, dtype=torch.float32: torch.zeros(n * 256, dtype=dtype)   # n KiB of float32
    params = [kb(600), kb(600), kb(600), kb(600), kb(600), kb(16, torch.float64), kb(16, torch.float64)]
    buckets = _layout_buckets(params, first_bucket_bytes=1 << 20, bucket_bytes=2 << 20)
    sizes = [len(b) for b in buckets]
    assert sizes == [1, 3, 1, 2]      # 600K alone (cap 1M), then 3x600K <= 2M, 600K, then the float64 pair apart
    assert [p for b in buckets for p in b] == params


def test_model_mismatch_message_names_parameter_and_ranks():
    rank0 = [("fc.weight", (10, 4), "float32", True), ("fc.bias", (10,), "float32", True)]
    rank1 = [("fc.weight", (10, 3), "float32", True), ("fc.bias", (10,), "float32", True)]
    rank2 = [("fc.weight", (10, 4), "float32", True)]
    message = _describe_model_mismatch([rank0, rank1, rank2])
    assert "'fc.weight'" in message and "(10, 4)" in message and "(10, 3)" in message
    assert "ranks [0, 2]" in message and "ranks [1]" in message
    assert "'fc.bias' exists on ranks [0, 1] but not on ranks [2]" in message
    reordered = _describe_model_mismatch([rank0, list(reversed(rank0))])
    assert "different order" in reordered


def _tiny_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2)).double()


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("make_optimizer", [
    lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    lambda params: torch.optim.Adam(params, lr=0.01),
])
def test_one_rank_distributed_optimizer_equals_plain_optimizer(rt, make_optimizer, overlap):
    plain_model, dist_model = _tiny_model(0), _tiny_model(0)
    plain = make_optimizer(plain_model.parameters())
    dist = hvd.DistributedOptimizer(make_optimizer(dist_model.parameters()),
                                    named_parameters=dist_model.named_parameters(), overlap=overlap)
    assert isinstance(dist, type(plain)) and dist.overlaps_backward is overlap
    generator = torch.Generator().manual_seed(1)
    for _ in range(5):
        x = torch.randn(8, 5, generator=generator, dtype=torch.float64)
        for model, opt in ((plain_model, plain), (dist_model, dist)):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
    for a, b in zip(plain_model.parameters(), dist_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_named_parameters_must_cover_the_optimizer(rt):
    model = _tiny_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="missing from named_parameters"):
        hvd.DistributedOptimizer(opt, named_parameters=list(model.named_parameters())[:2])


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("steps_before", [0, 2])      # step 1 watches the ready order; later steps use fast hooks
def test_too_many_backward_passes_is_an_error_at_step(rt, overlap, steps_before):
    model, passes = _tiny_model(0), 2
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), overlap=overlap,
                                   backward_passes_per_step=passes)
    x = torch.ones(2, 5, dtype=torch.float64)
    for _ in range(steps_before):
        opt.zero_grad()
        for _ in range(passes):
            model(x).sum().backward()
        opt.step()
    for _ in range(passes + 1):
        model(x).sum().backward()
    with pytest.raises(RingtrainError, match=r"'param\.\d' was computed 3 times, more than backward_passes_per_step=2"):
        opt.step()
    opt.zero_grad()                          # the failed step left nothing behind: a normal step follows
    for _ in range(passes):
        model(x).sum().backward()
    opt.step()


def test_zero_grad_with_pending_allreduce_is_an_error(rt):
    model = torch.nn.Linear(5, 3).double()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), first_bucket_mb=0, overlap=True)
    model(torch.ones(2, 5, dtype=torch.float64)).sum().backward()
    with pytest.raises(RingtrainError, match="before optimizer.step"):
        opt.zero_grad()
    opt.step()
    opt.zero_grad()


def test_zero_grad_after_backward_drops_the_unreduced_gradients(rt):
    # reduced after backward, nothing is in flight: zero_grad() is plain torch's (gradients and pass count go)
    model = torch.nn.Linear(5, 3).double()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), overlap=False)
    x = torch.ones(2, 5, dtype=torch.float64)
    model(x).sum().backward()
    opt.zero_grad()
    assert model.weight.grad is None
    model(x).sum().backward()                # without the reset, this would be a second pass of backward_passes=1
    opt.step()


@pytest.mark.parametrize("overlap", [True, False])
def test_gradients_become_views_of_one_bucket_buffer(rt, overlap):
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2)).double()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), overlap=overlap)
    x = torch.ones(2, 5, dtype=torch.float64)
    for _ in range(3):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    storages = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(storages) == 1                # every gradient lives in the one bucket: nothing packed per step
    opt.zero_grad()                          # views are zeroed, not dropped
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    model.zero_grad()                        # torch's own zero_grad drops them: the next step makes them views again
    model(x).sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    opt.synchronize()
    assert {p.grad.untyped_storage().data_ptr() for p in model.parameters()} == storages
    for p, w in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad, w, rtol=0, atol=0)


def test_after_backward_one_parameter_per_bucket_counts_the_passes_from_the_second_step(rt):
    """After backward the hooks only count passes: from step 2 on one parameter per bucket of several does (the
    last whose gradient came in step 1, the input layer's), and what step() checks still holds -- a backward after
    synchronize() is reduced again, more passes than backward_passes_per_step is an error naming it."""
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2)).double()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), overlap=False,
                                   named_parameters=model.named_parameters())
    hooks = opt._ringtrain
    buckets = hooks.reducer.buckets
    assert [len(b.members) for b in buckets] == [4]
    x = torch.ones(2, 5, dtype=torch.float64)
    assert len(hooks.hooks) == 4                       # step 1: every parameter
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    assert len(hooks.hooks) == 1 and hooks.counted == {buckets[0].name: model[0].weight}
    # step 1 counted on the gradient accumulators: no other parameter was ever hooked (a removed hook would still
    # cost in every backward)
    assert [p for p in model.parameters() if p._post_accumulate_grad_hooks is not None] == [model[0].weight]
    opt.zero_grad()
    model(x).sum().backward()
    assert len(buckets[0].arrivals) == 1
    opt.synchronize()
    assert hooks.reducer.is_synchronized()
    model(x).sum().backward()                          # a backward after synchronize(): step() must reduce it
    assert not hooks.reducer.is_synchronized()
    opt.step()
    opt.zero_grad()
    for _ in range(2):
        model(x).sum().backward()
    with pytest.raises(RingtrainError, match="'0.weight' was computed 2 times, more than backward_passes_per_step=1"):
        opt.step()


def _train_until_gradients_are_views(opt, model):
    """Two steps after backward: the buckets' gradients are views from then on. Returns the input used."""
    x = torch.ones(2, 5, dtype=torch.float64)
    for _ in range(2):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    return x


def test_zero_grad_clears_parameters_outside_the_buckets(rt):
    # frozen when the optimizer was built (never communicated), trained later: torch's zero_grad still clears it
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 2)).double()
    model[0].requires_grad_(False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), overlap=False)
    x = _train_until_gradients_are_views(opt, model)
    model[0].requires_grad_(True)
    model(x).sum().backward()
    assert model[0].weight.grad is not None
    opt.zero_grad()
    assert model[0].weight.grad is None and model[1].weight.grad is not None


def test_zero_grad_clears_parameters_added_to_the_optimizer_later(rt):
    # the parameters outside the buckets are looked up again when param_groups change: a group added after
    # construction (add_param_group), or a group's params list replaced, is never communicated but still cleared
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 2)).double()
    extra, another = torch.nn.Linear(5, 3).double(), torch.nn.Linear(5, 3).double()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), overlap=False)
    x = _train_until_gradients_are_views(opt, model)
    opt.add_param_group({"params": list(extra.parameters())})
    extra(x).sum().backward()
    opt.zero_grad()
    assert extra.weight.grad is None and extra.bias.grad is None
    opt.param_groups[-1]["params"] = [another.weight]
    another(x).sum().backward()
    opt.zero_grad(set_to_none=False)
    assert another.weight.grad is not None and not another.weight.grad.any()
    assert another.bias.grad is not None and another.bias.grad.any()      # in no group: torch leaves it alone


def test_bucket_layout_after_backward_packs_small_tensors_together_and_large_ones_together():
    kb = lambda n, dtype=torch.float32: torch.zeros(n * 256, dtype=dtype)
    small, big, small64 = kb(4), kb(1024), kb(4, torch.float64)
    params = [small, big, small64, kb(4), kb(2048), kb(4)]
    kept = _layout_buckets(params, first_bucket_bytes=1 << 20, bucket_bytes=2 << 20, alone_bytes=1 << 20)
    assert [len(b) for b in kept] == [1, 1, 1, 1, 1, 1]     # consecutive runs: every big or dtype change cuts
    ids = lambda buckets: [[id(p) for p in b] for b in buckets]
    packed = _layout_buckets(params, 2 << 20, 2 << 20, 1 << 20, keep_order=False)
    # 1 MB + 2 MB exceed the 2 MB cap: the large ones go in two buckets, never with small ones
    assert ids(packed) == [[id(big)], [id(small), id(params[3]), id(params[5])], [id(small64)], [id(params[4])]]
    packed = _layout_buckets(params, 4 << 20, 4 << 20, 1 << 20, keep_order=False)
    assert ids(packed) == [[id(small), id(params[3]), id(params[5])], [id(big), id(params[4])], [id(small64)]]
    alone = _layout_buckets(params, 4 << 20, 4 << 20, 1 << 20, keep_order=False, large_alone=True)
    assert ids(alone) == [[id(big)], [id(params[4])], [id(small), id(params[3]), id(params[5])], [id(small64)]]


def test_bucket_layout_after_backward_large_buckets_hold_up_to_their_own_cap():
    kb = lambda n: torch.zeros(n * 256)
    params = [kb(4), kb(1024), kb(4), kb(1536), kb(2048)]
    ids = lambda buckets: [[id(p) for p in b] for b in buckets]
    large_cap = _layout_buckets(params, 2 << 20, 2 << 20, 1 << 20, keep_order=False, large_bucket_bytes=3 << 20)
    # 1 MB + 1.5 MB share a 3 MB large bucket; 2 MB more would pass it; the small ones keep the 2 MB cap
    assert ids(large_cap) == [[id(params[1]), id(params[3])], [id(params[0]), id(params[2])], [id(params[4])]]
    assert ids(_layout_buckets(params, 2 << 20, 2 << 20, 1 << 20, keep_order=False)) == [
        [id(params[1])], [id(params[3])], [id(params[0]), id(params[2])], [id(params[4])]]


def test_after_backward_large_gradients_share_buckets_up_to_the_fusion_threshold(rt):
    """bucket_cap_mb=2: two 1.5 MB gradients still share one bucket after backward (up to the fusion threshold,
    the shm window's capacity), the small ones keep the 2 MB cap; with overlap each large one travels alone."""
    from ringtrain.core import state
    layers = [torch.nn.Linear(768, 512, bias=False), torch.nn.Linear(512, 768, bias=False)]
    layers += [torch.nn.Linear(256, 256) for _ in range(12)]          # 12 x 257 KB: small, two 2 MB buckets
    model = torch.nn.Sequential(*layers)
    assert state.config().fusion_threshold >= 3 << 20
    for overlap in (False, True):
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), overlap=overlap,
                                       bucket_cap_mb=2)
        reducer = opt._ringtrain.reducer
        large = [len(reducer.bucket_of(layer.weight).members) for layer in layers[:2]]
        assert large == ([1, 1] if overlap else [2, 2]), (overlap, large)
        small = [sum(m.nbytes for m in b.members) for b in reducer.buckets if b.members[0].nbytes < 1 << 20]
        assert len(small) >= 2 and max(small) <= 2 << 20, small


def test_after_backward_the_last_ready_bucket_is_reduced_first(rt):
    """After backward, step() reduces the buckets in reverse order: they fill in expected ready order, so the last
    holds the gradients backward wrote last, the likeliest still in the cache."""
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), overlap=False, bucket_cap_mb=0.02,
                                   first_bucket_mb=0.02)
    hooks = opt._ringtrain
    submitted = []
    real_launch = hooks.reducer.launch          # the binding's launch, which the Reducer calls
    hooks.reducer.launch = lambda bucket, sync: submitted.append(bucket.index) or real_launch(bucket, sync)
    for step in range(3):
        submitted.clear()
        opt.zero_grad()
        model(torch.ones(2, 64)).sum().backward()
        opt.step()
        assert submitted == list(range(len(hooks.reducer.buckets)))[::-1], (step, submitted)
    assert len(submitted) >= 3


def test_device_is_cpu_without_gpu(rt):
    assert hvd.device() == torch.device("cpu")
