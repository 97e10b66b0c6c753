"""SyncBatchNorm: batch normalisation with statistics over the whole distributed batch.

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), hvd.SyncBatchNorm(8), torch.nn.ReLU())

In training, every rank's forward uses the mean and variance of the concatenation of all ranks' batches (one
allreduce of per-channel sums, sums of squares and counts; batch sizes may differ per rank), and backward
exchanges the two per-channel gradient sums it needs, so outputs, input gradients and running statistics equal
torch.nn.BatchNorm*'s on the concatenated batch. weight/bias gradients stay this rank's share (the optimizer's
allreduce combines them), as in Horovod and torch.nn.SyncBatchNorm. In eval mode it is a plain BatchNorm on the
running statistics. Works for any input of shape (N, C, ...), so one class covers BatchNorm1d/2d/3d.
"""
import torch

from ringtrain.core.process_sets import global_process_set

from . import functions
from .functions import Sum


def _allreduce_sum(tensor, process_set):
    return functions.allreduce_async(tensor, op=Sum, process_set=process_set).wait()


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, process_set):
        channels = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        wide = x.detach().double()     # sums in float64: E[x^2] - E[x]^2 loses nothing that matters then
        local = torch.cat([wide.sum(dims), (wide * wide).sum(dims),
                           torch.tensor([x.numel() / channels], dtype=torch.float64)])
        total = _allreduce_sum(local, process_set)
        count = total[-1].item()
        mean = total[:channels] / count
        var = total[channels:2 * channels] / count - mean * mean
        invstd = torch.rsqrt(var.clamp(min=0) + eps)
        if running_mean is not None:
            with torch.no_grad():
                unbiased = var * (count / max(count - 1, 1))
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        shape = [1, channels] + [1] * (x.dim() - 2)
        mean_, invstd_ = mean.to(x.dtype).view(shape), invstd.to(x.dtype).view(shape)
        y = (x - mean_) * invstd_
        if weight is not None:
            y = y * weight.view(shape) + bias.view(shape)
        ctx.save_for_backward(x, weight, mean_, invstd_)
        ctx.count, ctx.process_set, ctx.dims = count, process_set, dims
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, weight, mean_, invstd_ = ctx.saved_tensors
        dims, channels = ctx.dims, x.shape[1]
        xmu = x - mean_
        sum_dy = grad_y.sum(dims)
        sum_dy_xmu = (grad_y * xmu).sum(dims)
        grad_weight = grad_bias = None
        if weight is not None:
            grad_weight = sum_dy_xmu * invstd_.view(-1)       # this rank's share; the optimizer averages it
            grad_bias = sum_dy
        total = _allreduce_sum(torch.cat([sum_dy, sum_dy_xmu]).double(), ctx.process_set)
        shape = mean_.shape
        mean_dy = (total[:channels] / ctx.count).to(x.dtype).view(shape)
        mean_dy_xmu = (total[channels:] / ctx.count).to(x.dtype).view(shape)
        grad_x = (grad_y - mean_dy - xmu * invstd_ * invstd_ * mean_dy_xmu) * invstd_
        if weight is not None:
            grad_x = grad_x * weight.view(shape)
        return grad_x, grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """torch.nn.BatchNorm* with statistics synchronised over the ranks of `process_set` in training."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True,
                 process_set=global_process_set, device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.process_set = process_set

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects input of shape (N, C, ...), got {tuple(input.shape)}")

    def forward(self, input):
        self._check_input_dim(input)
        uses_batch_stats = self.training or self.running_mean is None
        if not uses_batch_stats or functions.set_size(self.process_set) == 1:
            return super().forward(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:         # cumulative moving average, as torch's BatchNorm
                factor = 1.0 / float(self.num_batches_tracked)
        track = self.training and self.running_mean is not None
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias,
                                            self.running_mean if track else None,
                                            self.running_var if track else None,
                                            self.eps, factor, self.process_set)


__all__ = ["SyncBatchNorm"]
