"""Parameter consistency check on N ranks: identical parameters pass; one rank's drifted parameter is named."""
import pytest
import torch

import ringtrain
import ringtrain.torch as hvd
from ringtrain.torch.consistency import (ParameterDivergenceError, check_parameters, describe_divergence,
                                         maybe_check, parameter_digest)

pytestmark = pytest.mark.mpi(min_size=2)


@pytest.fixture(scope="module")
def model():
    if not hvd.is_initialized():
        hvd.init()
    torch.manual_seed(0)                     # same weights on every rank
    return torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))


def test_identical_parameters_pass(model):
    # the precondition, checked independently of the digests: every rank really holds the same values
    everyone = hvd.allgather_object([p.detach().numpy().copy() for p in model.parameters()], name="check.values")
    for rank, values in enumerate(everyone):
        for got, want in zip(values, everyone[0]):
            assert got.tobytes() == want.tobytes(), f"rank {rank}: the test's model is not the same everywhere"
    assert check_parameters(model.named_parameters()) is None
    # equal values in other tensors (fresh copies, another memory layout) are still equal
    copies = [(name, p.detach().clone().t().contiguous().t()) for name, p in model.named_parameters()]
    assert check_parameters(copies, step=3) is None


def test_one_rank_drifting_is_named_with_its_parameter(model):
    odd = hvd.size() - 1
    params = dict(model.named_parameters())
    drifted = {name: p.detach().clone() for name, p in params.items()}
    if hvd.rank() == odd:
        drifted["1.bias"][0] += 1e-7          # one ulp-scale change is enough
    with pytest.raises(ParameterDivergenceError) as info:
        check_parameters(drifted.items(), step=40)
    message = str(info.value)
    assert "'1.bias'" in message and "'1.weight'" not in message and "'0.weight'" not in message
    assert f"rank {odd} differ" in message and "at step 40" in message
    assert f"ranks {','.join(map(str, range(odd)))} agree" in message or (odd == 1 and "rank 0 agree" in message)


def test_maybe_check_runs_every_k_steps(model):
    config = ringtrain.config()
    saved = config.check_every
    config.check_every = 2
    try:
        drifted = [(name, p.detach().clone() + (hvd.rank() == 0)) for name, p in model.named_parameters()]
        assert maybe_check(1, drifted) is False           # not a checking step: no collective, no error
        with pytest.raises(ParameterDivergenceError, match="'0.weight'"):
            maybe_check(2, lambda: drifted)
        config.check_every = 0
        assert maybe_check(2, drifted) is False           # off
    finally:
        config.check_every = saved


def test_digest_sees_every_dtype_and_names_mismatched_models():
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool):
        a = torch.zeros(7, dtype=dtype)
        b = a.clone()
        b[3] = 1
        assert parameter_digest(a) == parameter_digest(a.clone()) != parameter_digest(b), dtype
    assert parameter_digest(torch.zeros(0)) != parameter_digest(torch.zeros(0, 2))
    message = describe_divergence([[("w", "aa"), ("b", "bb")], [("w", "aa")]])
    assert "rank 1" in message and "'b'" in message
