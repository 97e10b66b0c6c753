"""Horovod 0.28.1's own PyTorch examples use no `hvd.<name>` that ringtrain.torch lacks, --use-adasum paths included.

The names below were read off the scripts in horovod/horovod examples/pytorch/ (listed per script); each must exist
in ringtrain.torch, the DistributedOptimizer / broadcast keywords they pass must be accepted, and the objects they use
must behave as those scripts expect on one rank (Adasum: the Adasum optimizer, a local step on one rank).
"""
import inspect

import pytest
import torch

import ringtrain.torch as hvd

SCRIPTS = {
    # examples/pytorch/pytorch_mnist.py
    "pytorch_mnist.py": ["init", "rank", "size", "local_rank", "local_size", "nccl_built", "allreduce",
                         "broadcast_parameters", "broadcast_optimizer_state", "Compression", "DistributedOptimizer",
                         "Adasum", "Average"],
    # examples/pytorch/pytorch_imagenet_resnet50.py
    "pytorch_imagenet_resnet50.py": ["init", "rank", "size", "local_rank", "local_size", "nccl_built", "allreduce",
                                     "broadcast", "broadcast_parameters", "broadcast_optimizer_state", "Compression",
                                     "DistributedOptimizer", "Adasum", "Average"],
    # examples/pytorch/pytorch_synthetic_benchmark.py
    "pytorch_synthetic_benchmark.py": ["init", "rank", "size", "local_rank", "local_size", "nccl_built",
                                       "SyncBatchNorm", "broadcast_parameters", "broadcast_optimizer_state",
                                       "Compression", "DistributedOptimizer", "Adasum", "Average"],
}
# keyword arguments those scripts pass
OPTIMIZER_KWARGS = ["named_parameters", "compression", "backward_passes_per_step", "op", "gradient_predivide_factor"]


@pytest.fixture(scope="module")
def rt():
    if not hvd.is_initialized():
        hvd.init()
    return hvd


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_every_name_the_script_uses_exists(script):
    missing = [name for name in SCRIPTS[script] if not hasattr(hvd, name)]
    assert not missing, f"{script} uses hvd.{missing} which ringtrain.torch lacks"
    assert hasattr(hvd.Compression, "fp16") and hasattr(hvd.Compression, "none")


def test_their_keywords_are_accepted():
    params = inspect.signature(hvd.DistributedOptimizer).parameters
    assert all(k in params for k in OPTIMIZER_KWARGS)
    assert "root_rank" in inspect.signature(hvd.broadcast_parameters).parameters
    assert "name" in inspect.signature(hvd.broadcast).parameters and "name" in inspect.signature(hvd.allreduce).parameters


def test_their_code_paths_run_on_one_rank(rt):
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), hvd.SyncBatchNorm(4))   # torchvision's norm_layer(n)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    # --use-adasum: on one rank the Adasum optimizer's step is the plain step
    adasum_model = torch.nn.Linear(3, 2)
    plain_model = torch.nn.Linear(3, 2)
    plain_model.load_state_dict(adasum_model.state_dict())
    adasum = hvd.DistributedOptimizer(torch.optim.SGD(adasum_model.parameters(), lr=0.1, momentum=0.9),
                                      named_parameters=adasum_model.named_parameters(), op=hvd.Adasum)
    plain = torch.optim.SGD(plain_model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        for m, o in ((adasum_model, adasum), (plain_model, plain)):
            o.zero_grad()
            m(torch.ones(4, 3)).square().sum().backward()
            o.step()
    for p, q in zip(adasum_model.parameters(), plain_model.parameters()):
        torch.testing.assert_close(p, q)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=hvd.Compression.fp16, backward_passes_per_step=1,
                                         op=hvd.Average, gradient_predivide_factor=1.0)
    model(torch.randn(2, 3, 5, 5)).sum().backward()
    optimizer.synchronize()
    with optimizer.skip_synchronize():
        optimizer.step()
    assert hvd.broadcast(torch.tensor(3), root_rank=0, name="resume_from_epoch").item() == 3
    assert hvd.allreduce(torch.tensor(2.0), name="avg_loss").item() == 2.0
