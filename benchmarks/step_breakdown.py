"""Where a synchronous training step's time goes on each rank: forward+backward, the allreduce (opt.synchronize()),
and the optimizer step -- to tell communication from waiting for a slower rank.

    mpiexec -n 2 python benchmarks/step_breakdown.py [--model convnet|mlp] [--steps 25] [--json out.json]

Every step starts at a barrier, so a rank's synchronize() time is the allreduce plus the time it waits for the
slowest rank's backward to end. The slowest rank's synchronize() is the communication itself; the fastest rank's
minus that is the imbalance between the ranks' compute, which no allreduce can hide.
"""
import argparse
import json
import os
import sys
import time

import numpy as np
import torch
from mpi4py import MPI

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
sys.path.append(os.path.dirname(BENCH_DIR))

import train_scaling  # noqa: E402  (the same models and data as the scaling benchmark)

import ringtrain  # noqa: E402
import ringtrain.torch as hvd  # noqa: E402

WARMUP = 5


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="convnet", choices=train_scaling.MODELS)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    comm = MPI.COMM_WORLD
    width = 64 if args.model == "convnet" else 54
    model = train_scaling.build_model(torch, args.model, width)
    inputs, labels = train_scaling.synthetic_batch(torch, args.model, width, hvd.rank(), args.batch)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(), overlap=False)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    loss_fn = torch.nn.CrossEntropyLoss()
    rows = []
    for _ in range(WARMUP + args.steps):
        comm.Barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss_fn(model(inputs), labels).backward()
        t1 = time.perf_counter()
        opt.synchronize()
        t2 = time.perf_counter()
        with opt.skip_synchronize():
            opt.step()
        rows.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
    mine = np.median(np.array(rows[WARMUP:]) * 1e3, axis=0).tolist()
    everyone = comm.gather(mine, root=0)
    if hvd.rank() == 0:
        print(f"# {args.model}, {hvd.size()} ranks, batch {args.batch}, median of {args.steps} steps (ms), "
              f"transport {ringtrain.transport_name()}, load average {os.getloadavg()[0]:.2f}")
        print(f"{'rank':>4} {'fwd+bwd':>9} {'synchronize':>12} {'step':>7}")
        for r, (compute, sync, step) in enumerate(everyone):
            print(f"{r:>4} {compute:9.1f} {sync:12.2f} {step:7.2f}")
        slow = max(everyone, key=lambda row: row[0])
        fast = min(everyone, key=lambda row: row[0])
        print(f"# slowest rank's synchronize (the allreduce): {slow[1]:.2f} ms; compute imbalance "
              f"(slowest - fastest fwd+bwd): {slow[0] - fast[0]:.1f} ms")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"model": args.model, "ranks": hvd.size(), "per_rank_ms": everyone}, f, indent=1)
    hvd.shutdown()


if __name__ == "__main__":
    main()
