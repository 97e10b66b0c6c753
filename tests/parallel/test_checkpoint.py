"""Checkpoint/resume on N ranks: training k steps, saving, restoring into fresh (differently initialised) models and
training k more gives parameters bitwise equal to training 2k steps without a break."""
import shutil
import tempfile

import pytest
import torch

import ringtrain.torch as hvd
from ringtrain.torch.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

pytestmark = pytest.mark.mpi(min_size=2)
K = 3


@pytest.fixture(scope="module")
def shared_dir():
    if not hvd.is_initialized():
        hvd.init()
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    path = comm.bcast(tempfile.mkdtemp(prefix="ringtrain-ckpt-") if comm.rank == 0 else None, root=0)
    yield path
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


def make(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    return model, opt


def train(model, opt, steps):
    for step in steps:
        g = torch.Generator().manual_seed(1000 * step + hvd.rank())    # each rank its own shard of each step
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def start(seed):
    model, opt = make(seed)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    return model, opt


def test_resume_is_bitwise_identical_to_uninterrupted_run(shared_dir):
    path = f"{shared_dir}/resume.pt"
    straight, straight_opt = start(seed=1)
    train(straight, straight_opt, range(2 * K))

    first, first_opt = start(seed=1)
    train(first, first_opt, range(K))
    save_checkpoint(path, first, first_opt, step=K, tag="half")

    # a "new process": different weights on every rank, no optimizer state until the checkpoint arrives
    resumed, resumed_opt = make(seed=50 + hvd.rank())
    extra = load_checkpoint(path, resumed, resumed_opt)
    assert extra == {"step": K, "tag": "half"}
    for (name, a), b in zip(first.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), f"rank {hvd.rank()}: {name} not restored"
    train(resumed, resumed_opt, range(K, 2 * K))

    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), f"rank {hvd.rank()}: {name} differs after resume, max |diff| {(a - b).abs().max()}"
    assert not torch.equal(first.state_dict()["0.weight"], straight.state_dict()["0.weight"])   # it did train on


def test_only_rank_zero_writes_and_every_rank_sees_the_file(shared_dir):
    path = f"{shared_dir}/only0.pt"
    model, _ = make(seed=2)
    save_checkpoint(path, model, None, owner=hvd.rank())
    extra = torch.load(path, weights_only=True)["extra"]
    assert extra == {"owner": 0}                       # rank 0's values, readable on every rank after the call


def test_missing_checkpoint_fails_on_every_rank(shared_dir):
    model, opt = make(seed=3)
    with pytest.raises(CheckpointError, match="load of checkpoint .*missing.pt.* failed on rank 0: FileNotFoundError"):
        load_checkpoint(f"{shared_dir}/missing.pt", model, opt)
    hvd.barrier()                                      # still in step afterwards
