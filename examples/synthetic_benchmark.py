"""Training throughput on random data, as Horovod's pytorch_synthetic_benchmark.py, sized for CPUs.

    python examples/synthetic_benchmark.py                         # 1 rank
    mpirun -np 2 python examples/synthetic_benchmark.py            # ringtrain DistributedOptimizer
    mpirun -np 2 python examples/synthetic_benchmark.py --ddp      # torch DistributedDataParallel (gloo), same model

Prints img/s per rank (mean +- std over iterations) and in total, plus the step time, so runs at 1 and N ranks give
the scaling efficiency T(N) / (N * T(1)) in throughput terms. In --ddp mode ringtrain only tells each rank its rank,
the world size and rank 0's address (then shuts down); gradients go through torch.distributed with gloo.
"""
import argparse
import os
import socket
import statistics
import time

import torch
import torch.nn as nn

import ringtrain.torch as hvd


# ------------------------------------------------------------------------------------------------ built-in models

class ConvNet(nn.Module):
    """Three conv blocks and a wide classifier: ~6.3 M parameters, mostly in the first linear layer, so a step
    moves ~25 MB of float32 gradients, the regime where the allreduce matters."""

    def __init__(self, classes=10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(128 * 4 * 4, 2048), nn.ReLU(),
                                        nn.Linear(2048, 1024), nn.ReLU(), nn.Linear(1024, classes))

    def forward(self, x):
        return self.classifier(self.features(x))


class MLP(nn.Module):
    """Compute-light, gradient-heavy: the worst case for communication (~4.2 M parameters)."""

    def __init__(self, classes=10):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 1024), nn.ReLU(), nn.Linear(1024, 1024),
                                 nn.ReLU(), nn.Linear(1024, classes))

    def forward(self, x):
        return self.net(x)


class ResidualBlock(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels),
                                  nn.ReLU(), nn.Conv2d(channels, channels, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(channels))

    def forward(self, x):
        return torch.relu(x + self.body(x))


class TinyResNet(nn.Module):
    """Compute-heavy, gradient-light (~0.7 M parameters): communication should hide behind backward."""

    def __init__(self, classes=10, width=64):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            ResidualBlock(width), nn.MaxPool2d(2), ResidualBlock(width), nn.MaxPool2d(2), ResidualBlock(width),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, classes))

    def forward(self, x):
        return self.net(x)


MODELS = {"convnet": ConvNet, "mlp": MLP, "resnet_tiny": TinyResNet}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="convnet")
    parser.add_argument("--batch-size", type=int, default=32, help="images per rank per step")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--num-warmup-batches", type=int, default=5)
    parser.add_argument("--num-batches-per-iter", type=int, default=5)
    parser.add_argument("--num-iters", type=int, default=10)
    parser.add_argument("--compression", choices=["none", "fp16", "bf16"], default="none",
                        help="gradient compression on the wire (ringtrain mode)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: cores // local ranks)")
    parser.add_argument("--ddp", action="store_true", help="torch DistributedDataParallel with gloo instead")
    parser.add_argument("--master-port", type=int, default=0, help="--ddp: rank 0's port (0: pick a free one)")
    return parser.parse_args()


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def setup_ddp(args, model):
    """Bootstrap torch.distributed from ringtrain's rank/size, then get ringtrain out of the way."""
    rank, size = hvd.rank(), hvd.size()
    address = hvd.broadcast_object((socket.gethostname() if size > 1 else "127.0.0.1",
                                    args.master_port or free_port()), root_rank=0, name="ddp_address")
    hvd.shutdown()
    torch.distributed.init_process_group("gloo", init_method=f"tcp://{address[0]}:{address[1]}",
                                         rank=rank, world_size=size)
    return nn.parallel.DistributedDataParallel(model), rank, size


def main():
    args = parse_args()
    hvd.init()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = args.threads or max(1, cores // hvd.local_size())
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = MODELS[args.model]()
    parameters = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    if args.ddp:
        transport = "gloo (torch DDP)"
        model, rank, size = setup_ddp(args, model)

        def gather(value):
            values = [None] * size
            torch.distributed.all_gather_object(values, value)
            return values
    else:
        import ringtrain
        transport = "ringtrain " + ringtrain.transport_name()
        rank, size = hvd.rank(), hvd.size()
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             compression=getattr(hvd.Compression, args.compression))
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)

        def gather(value):
            return hvd.allgather_object(value, name="benchmark_gather")

    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    target = torch.randint(0, 10, (args.batch_size,))

    def benchmark_step():
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(data), target).backward()
        optimizer.step()

    if rank == 0:
        print(f"model {args.model} ({parameters / 1e6:.2f} M parameters)  batch {args.batch_size}/rank  "
              f"ranks {size}  threads/rank {threads}  gradients via {transport}", flush=True)
    for _ in range(args.num_warmup_batches):
        benchmark_step()
    rates = []
    for iteration in range(args.num_iters):
        start = time.perf_counter()
        for _ in range(args.num_batches_per_iter):
            benchmark_step()
        rate = args.batch_size * args.num_batches_per_iter / (time.perf_counter() - start)
        rates.append(rate)
        if rank == 0:
            print(f"iter #{iteration}: {rate:.1f} img/s per rank", flush=True)

    per_rank = gather((statistics.mean(rates), statistics.pstdev(rates)))
    if rank == 0:
        mean, std = per_rank[0]
        total = sum(m for m, _ in per_rank)
        total_std = sum(s * s for _, s in per_rank) ** 0.5
        step_ms = 1e3 * args.batch_size / statistics.mean(m for m, _ in per_rank)
        print(f"img/s per rank (rank 0): {mean:.1f} +- {std:.1f}")
        print(f"img/s total on {size} rank(s): {total:.1f} +- {total_std:.1f}")
        print(f"step time: {step_ms:.1f} ms  (RESULT mode={'ddp' if args.ddp else 'ringtrain'} model={args.model} "
              f"ranks={size} total_img_s={total:.1f} step_ms={step_ms:.2f})", flush=True)
    if args.ddp:
        torch.distributed.destroy_process_group()
    else:
        hvd.shutdown()


if __name__ == "__main__":
    main()
