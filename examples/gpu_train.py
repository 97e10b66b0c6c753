"""One GPU per rank: a small convnet on handwritten digits, on `hvd.device()` (the CPU when there is no GPU).

    mpirun -np 2 python examples/gpu_train.py                     # one rank per GPU; on a CPU-only machine, the CPU
    mpirun -np 2 python examples/gpu_train.py --fp16-allreduce    # gradients travel as float16
    mpirun -np 2 python examples/gpu_train.py --amp               # bfloat16 autocast for forward and backward

`hvd.init()` binds each rank to GPU `local_rank % device_count` when cupy sees a GPU; `hvd.device()` is that GPU as
a torch.device, or `cpu` on machines without one, so this script runs unchanged on both. On GPUs install ringtrain
with the CUDA extra that matches your driver (`pip install -e ".[torch,cuda12]"`): the gradients of CUDA tensors are
averaged by ringtrain's own ring over NCCL send/recv on the GPU, never copied to the host.
"""
import argparse
import os
import time

import torch
import torch.nn as nn

import ringtrain.torch as hvd
from data import load_digits_split


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64, help="rows per rank per step")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate on one rank (scaled by the ranks)")
    parser.add_argument("--fp16-allreduce", action="store_true", help="compress gradients to float16 on the wire")
    parser.add_argument("--amp", action="store_true", help="bfloat16 autocast for the forward and backward passes")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


class DigitsNet(nn.Module):
    """Two 3x3 conv layers on the 8x8 digit images, then a linear classifier (9,930 parameters)."""

    def __init__(self, classes=10):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(32 * 4 * 4, classes))

    def forward(self, x):
        return self.body(x.view(-1, 1, 8, 8))


def main():
    args = parse_args()
    hvd.init()
    device = hvd.device()                                  # cuda:<local GPU> or cpu
    if device.type == "cpu":                               # CPU ranks sharing a node must not fight over cores
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        torch.set_num_threads(max(1, cores // hvd.local_size()))
    torch.manual_seed(args.seed)

    (x_train, y_train), (x_test, y_test) = load_digits_split(0.2, args.seed)
    # the whole data set is tiny: put it on the device once; each rank trains on its rows rank::size
    x_train, y_train = torch.from_numpy(x_train).to(device), torch.from_numpy(y_train).to(device)
    x_test, y_test = torch.from_numpy(x_test).to(device), torch.from_numpy(y_test).to(device)
    mine = torch.arange(hvd.rank(), len(y_train), hvd.size(), device=device)
    mine = mine[:len(y_train) // hvd.size()]               # equal step counts on every rank

    model = DigitsNet().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    if hvd.rank() == 0:
        print(f"ranks {hvd.size()}  device {device}  parameters {sum(p.numel() for p in model.parameters())}  "
              f"compression {'fp16' if args.fp16_allreduce else 'none'}  amp {args.amp}", flush=True)

    start = time.perf_counter()
    for epoch in range(args.epochs):
        generator = torch.Generator(device="cpu").manual_seed(args.seed * 1000 + epoch)
        order = mine[torch.randperm(len(mine), generator=generator).to(device)]
        model.train()
        for i in range(0, len(order), args.batch_size):
            rows = order[i:i + args.batch_size]
            optimizer.zero_grad()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp):
                loss = nn.functional.cross_entropy(model(x_train[rows]), y_train[rows])
            loss.backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            correct = (model(x_test).argmax(dim=1) == y_test).sum()
        # every rank scored the same test set: the average only checks that the ranks agree
        accuracy = hvd.allreduce(correct.double(), name="accuracy").item() / len(y_test)
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1:2d}/{args.epochs}  loss {loss.item():.4f}  test accuracy {accuracy:.4f}",
                  flush=True)
    if hvd.rank() == 0:
        print(f"final: ranks {hvd.size()}  device {device}  test accuracy {accuracy:.4f}  "
              f"train time {time.perf_counter() - start:.2f} s", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
