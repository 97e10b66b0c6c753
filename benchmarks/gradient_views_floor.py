"""What keeping gradients as views of one flat bucket costs plain torch, per step, with no communication at all.

    python benchmarks/gradient_views_floor.py [--model mlp] [--steps 400] [--json out.json]

One process, one thread, two copies of the same model and optimizer (SGD with momentum), stepped in turn in random
order so load on the machine falls on both alike:
  steal   torch's own loop: zero_grad() sets every .grad to None and backward hands its fresh gradients over
  views   every .grad a view of one flat buffer (as DistributedOptimizer keeps them after backward): zeroing is
          one fill of the buffer, and backward adds each fresh gradient into its view
Per phase (zero, fwd+bwd, step) the 25th percentile and the median over the steps, ms. The difference is a floor
for any data-parallel step that reduces one flat bucket: the allreduce and its bookkeeping come on top.
"""
import argparse
import json
import os
import random
import statistics
import sys
import time

import torch
from torch._utils import _unflatten_dense_tensors

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import train_models  # noqa: E402

PHASES = ("zero", "fwd+bwd", "step", "total")


def build(args):
    torch.manual_seed(0)
    model = train_models.build_model(torch, args.model, args.width)
    return model, torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9)


def timed_step(model, optimizer, zero, inputs, labels):
    loss_fn = torch.nn.functional.cross_entropy
    t0 = time.perf_counter()
    zero()
    t1 = time.perf_counter()
    loss_fn(model(inputs), labels).backward()
    t2 = time.perf_counter()
    optimizer.step()
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2, t3 - t0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp", choices=train_models.MODELS)
    parser.add_argument("--width", type=int, default=None, help="default: the scaling benchmark's (64, mlp 54)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.width is None:
        args.width = 54 if args.model == "mlp" else 64
    torch.set_num_threads(1)
    inputs, labels = train_models.synthetic_batch(torch, args.model, args.width, 0, args.batch)
    steal_model, steal_opt = build(args)
    views_model, views_opt = build(args)
    params = list(views_model.parameters())
    flat = torch.zeros(sum(p.numel() for p in params))
    for p, view in zip(params, _unflatten_dense_tensors(flat, [p.detach() for p in params])):
        p.grad = view
    runs = {"steal": (steal_model, steal_opt, steal_opt.zero_grad), "views": (views_model, views_opt, flat.zero_)}
    times = {name: [] for name in runs}
    warmup = 10
    for i in range(warmup + args.steps):
        order = list(runs)
        random.shuffle(order)
        for name in order:
            model, optimizer, zero = runs[name]
            row = timed_step(model, optimizer, zero, inputs, labels)
            if i >= warmup:
                times[name].append(row)
    # the two trained the same model on the same batch the same number of steps: they must agree
    same = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(steal_model.parameters(), params))
    summary = {}
    for name, rows in times.items():
        summary[name] = {}
        for phase, column in zip(PHASES, zip(*rows)):
            ordered = sorted(column)
            summary[name][phase] = {"p25": 1e3 * ordered[len(ordered) // 4], "median": 1e3 * statistics.median(ordered)}
    machine = common.machine_info()
    print(f"# ringtrain {machine['commit']}, {machine['date']}; {args.model}: "
          f"{len(params)} tensors, {flat.numel() * 4 / 2 ** 20:.2f} MB of float32 gradients, batch {args.batch}, "
          f"1 thread, {args.steps} steps each; load average {os.getloadavg()[0]:.2f}; parameters of the two "
          f"{'agree' if same else 'DIFFER'}")
    rows = [[name] + [f"{summary[name][p]['p25']:.3f} / {summary[name][p]['median']:.3f}" for p in PHASES]
            for name in runs]
    rows.append(["views - steal"] + [f"{summary['views'][p]['p25'] - summary['steal'][p]['p25']:+.3f} / "
                                     f"{summary['views'][p]['median'] - summary['steal'][p]['median']:+.3f}"
                                     for p in PHASES])
    print(common.format_table(["gradients"] + list(PHASES), rows, title="ms per step, p25 / median"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "model": args.model, "tensors": len(params), "steps": args.steps,
                       "same_parameters": same, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
