"""After backward, how often does a bucket's allreduce leave the engine's express path, and what does that cost?

    mpiexec -n 2 python benchmarks/express_fallbacks.py --model resnet18 --steps 60 --out express_fallbacks.txt

step() reduces each bucket synchronously: the engine first tries its express path (one agreement cycle on the
caller's thread, then the transport reads the gradients where they lie, see Engine.express). When that cycle does
not agree on this bucket alone (express() returns a handle: "decided otherwise"), or the path is busy (None:
something else in flight, the engine's thread holding the progress lock), the bucket goes the general path:
queued, agreed by the engine's thread, packed into the staging area and unpacked. Per rank and bucket: how many
calls took which path, and the median and mean ms of the binding's submit of that bucket (which includes any wait
for the slower rank). The first WARMUP steps are left out (names are new there: no express path yet).
"""
import argparse
import collections
import os
import sys
import time

import numpy as np
import torch

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)

import train_models  # noqa: E402
from common import format_table, machine_info, print_and_save, source_commit  # noqa: E402

import ringtrain.torch as hvd  # noqa: E402
from ringtrain.core import state  # noqa: E402

WARMUP = 3
PATHS = {"express": "express", "handle": "general (cycle decided otherwise)", "none": "general (express busy)"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18", choices=["convnet", "resnet18", "mlp"])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    width = 54 if args.model == "mlp" else 64
    torch.manual_seed(0)
    model = train_models.build_model(torch, args.model, width)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                   named_parameters=model.named_parameters(), overlap=False)
    inputs, labels = train_models.synthetic_batch(torch, args.model, width, hvd.rank(), args.batch)
    loss_fn = torch.nn.CrossEntropyLoss()

    engine, hooks = state.engine(), opt._ringtrain
    express, submit = engine.express, hooks.reducer.launch     # the binding's launch, called by the Reducer
    outcomes, calls = [], []

    def watched_express(*a):
        result = express(*a)
        outcomes.append("express" if result is True else "none" if result is None else "handle")
        return result

    def timed_submit(bucket, sync, **kwargs):
        outcomes.clear()
        start = time.perf_counter()
        result = submit(bucket, sync, **kwargs)
        # the last express attempt decided the path (a grouped bucket tries once)
        calls.append((bucket.index, outcomes[-1] if outcomes else "none", time.perf_counter() - start))
        return result

    engine.express, hooks.reducer.launch = watched_express, timed_submit
    try:
        for step in range(WARMUP + args.steps):
            if step == WARMUP:
                calls.clear()
            opt.zero_grad()
            loss_fn(model(inputs), labels).backward()
            opt.step()
    finally:
        engine.express, hooks.reducer.launch = express, submit
    sizes = {b.index: sum(m.nbytes for m in b.members) for b in hooks.reducer.buckets}
    by = collections.defaultdict(list)
    for index, path, seconds in calls:
        by[(index, path)].append(seconds * 1e3)
    mine = sorted((index, path, len(ms), float(np.median(ms)), float(np.mean(ms))) for (index, path), ms in by.items())
    everyone = hvd.allgather_object(mine, name="express_fallbacks")
    if hvd.rank() == 0:
        rows = [[str(r), str(index), f"{sizes[index] / (1 << 20):.2f} MB", PATHS[path], str(n), f"{median:.2f}",
                 f"{mean:.2f}"] for r, rank_rows in enumerate(everyone) for index, path, n, median, mean in rank_rows]
        info = machine_info()
        text = "\n".join([f"# {args.model}, {hvd.size()} ranks, {args.steps} steps after {WARMUP}, {info['date']}, "
                          f"{info['cores']} cores, commit {source_commit()}, load {load_before:.2f} -> "
                          f"{os.getloadavg()[0]:.2f}",
                          format_table(["rank", "bucket", "bytes", "path", "calls", "median ms", "mean ms"], rows,
                                       title="after backward, each bucket's submit in step() by the path it took")])
        print_and_save(text, args.out)


if __name__ == "__main__":
    main()
