"""CPU time per training step on ONE rank of the MLP of benchmarks/train_scaling.py (100 blocks of Linear(54) +
LayerNorm: 402 gradient tensors), plain torch vs DistributedOptimizer after backward and with overlap: what the
binding's Python costs per step (hooks, buckets, submission, waiting), with the allreduce itself the identity.
Process CPU time, not wall time: other jobs on the machine slow the wall clock but not this process's CPU time.

    python benchmarks/optimizer_overhead.py          # one line of JSON: CPU ms per step for each mode
"""
import json
import sys
import time

import torch

import ringtrain.torch as hvd

torch.set_num_threads(1)
STEPS, WARMUP, WIDTH, BLOCKS, BATCH = 60, 10, 54, 100, 32


def mlp():
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, WIDTH)]
    for _ in range(BLOCKS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.LayerNorm(WIDTH), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 10))


def cpu_ms_per_step(mode):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if mode != "plain":
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), overlap=(mode == "overlap"))
    x, y = torch.randn(BATCH, 16), torch.randint(0, 10, (BATCH,))
    for step in range(WARMUP + STEPS):
        if step == WARMUP:
            start = time.process_time()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return (time.process_time() - start) * 1000 / STEPS


hvd.init()
out = {mode: cpu_ms_per_step(mode) for mode in ("plain", "after_backward", "overlap")}
hvd.shutdown()
print(json.dumps(out))
