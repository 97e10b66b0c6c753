"""hvd.SyncBatchNorm on N ranks == torch.nn.BatchNorm on the concatenation of every rank's batch (one process):
outputs, input gradients, running statistics, the weight/bias gradients summed over ranks, and eval mode."""
import pytest
import torch

import ringtrain.torch as hvd


def batch_of(rank, channels, extra):
    g = torch.Generator().manual_seed(rank)
    return torch.randn((rank + 2, channels) + extra, generator=g, dtype=torch.float64) * (rank + 1) + rank


def upstream_of(rank, shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(50 + rank), dtype=torch.float64)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("reference_cls, extra, momentum", [(torch.nn.BatchNorm1d, (), 0.1),
                                                           (torch.nn.BatchNorm1d, (5,), None),
                                                           (torch.nn.BatchNorm2d, (3, 2), 0.3)])
def test_matches_batch_norm_on_the_concatenated_batch(reference_cls, extra, momentum):
    n, r, channels = hvd.size(), hvd.rank(), 4
    sync = hvd.SyncBatchNorm(channels, momentum=momentum).double()
    reference = reference_cls(channels, momentum=momentum).double()
    with torch.no_grad():
        for bn in (sync, reference):
            bn.weight.copy_(torch.linspace(0.5, 2.0, channels))
            bn.bias.copy_(torch.linspace(-1.0, 1.0, channels))
    batches = [batch_of(s, channels, extra) for s in range(n)]       # batch sizes differ: 2, 3, 4, ...
    for step in range(2):                                             # running stats accumulate over steps
        x = (batches[r] + step).requires_grad_(True)
        y = sync(x)
        (y * upstream_of(r, y.shape)).sum().backward()

        full = torch.cat([b + step for b in batches]).requires_grad_(True)
        ref_y = reference(full)
        sum((part * upstream_of(s, part.shape)).sum()
            for s, part in enumerate(torch.split(ref_y, [b.shape[0] for b in batches]))).backward()
        mine = torch.split(full.grad, [b.shape[0] for b in batches])[r]
        start = sum(b.shape[0] for b in batches[:r])
        torch.testing.assert_close(y.detach(), ref_y.detach()[start:start + x.shape[0]])
        torch.testing.assert_close(x.grad, mine)
        torch.testing.assert_close(sync.running_mean, reference.running_mean)
        torch.testing.assert_close(sync.running_var, reference.running_var)
        assert int(sync.num_batches_tracked) == step + 1
        # weight/bias gradients are this rank's share: their sum over ranks is the one-process gradient
        for mine_grad, ref_grad in ((sync.weight.grad, reference.weight.grad), (sync.bias.grad, reference.bias.grad)):
            torch.testing.assert_close(hvd.allreduce(mine_grad, op=hvd.Sum), ref_grad)
        for bn in (sync, reference):
            bn.zero_grad()

    sync.eval()
    reference.eval()
    probe = batch_of(r + 7, channels, extra)      # eval: running statistics only, no communication
    torch.testing.assert_close(sync(probe), reference(probe))


@pytest.mark.mpi(min_size=2)
def test_in_a_process_set_and_without_running_stats():
    n, r = hvd.size(), hvd.rank()
    pair = hvd.add_process_set([0, 1])
    try:
        if pair.included():
            sync = hvd.SyncBatchNorm(3, affine=False, track_running_stats=False, process_set=pair).double()
            x = batch_of(r, 3, ())
            full = torch.cat([batch_of(s, 3, ()) for s in (0, 1)])
            reference = torch.nn.BatchNorm1d(3, affine=False, track_running_stats=False).double()
            torch.testing.assert_close(sync(x), reference(full)[:2] if r == 0 else reference(full)[2:])
            sync.eval()              # no running stats: eval normalises with the (synchronised) batch statistics
            torch.testing.assert_close(sync(x), reference.eval()(full)[:2] if r == 0 else reference(full)[2:])
    finally:
        hvd.remove_process_set(pair)

