"""What the flight recorder and the straggler scores cost a small allreduce, measured in one job with each switched
on and off in turn (interleaved rounds, so load falls on every arm alike).

    mpiexec -n 2 python benchmarks/observability_overhead.py [--rounds 16] [--calls 1000] [--out FILE]

The call: a synchronous 4 KB float32 allreduce into a preallocated output (numpy `ringtrain.allreduce(x, out=y)` and
torch `hvd.allreduce_(t)` of zeros), the express path a training loop's small collectives take. Arms: everything on (the
default), the flight recorder off, the straggler scores off, both off. Each figure is the median over rounds of the
slowest rank's mean time per call; "on - off" is the median of the per-round differences (same round, same load).
Metrics cost nothing per call (a scrape reads what the engine keeps), so they are not an arm here.
"""
import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np                                     # noqa: E402
from mpi4py import MPI                                 # noqa: E402

ARMS = ("all on", "recorder off", "scores off", "all off")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--out")
    args = parser.parse_args()
    import torch
    import ringtrain.torch as hvd
    import ringtrain as rt
    from ringtrain.core import state
    torch.set_num_threads(1)
    hvd.init()
    engine = state.engine()
    recorder, scores = engine.recorder, engine.agreement.stragglers
    capacity = recorder.capacity
    comm = MPI.COMM_WORLD
    x, y = np.ones(1024, np.float32), np.empty(1024, np.float32)
    t = torch.zeros(1024)             # zeros: the in-place sum stays finite

    def numpy_call():
        rt.allreduce(x, op=rt.Sum, name="overhead.numpy", out=y)

    def torch_call():
        hvd.allreduce_(t, op=hvd.Sum, name="overhead.torch")

    forms = {"numpy out=": numpy_call, "torch allreduce_": torch_call}

    def arm(name):
        recorder.capacity = 0 if name in ("recorder off", "all off") else capacity
        engine.agreement.stragglers = None if name in ("scores off", "all off") else scores

    def timed(call, n):
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(n):
            call()
        mine = (time.perf_counter() - start) / n * 1e6
        return comm.allreduce(mine, op=MPI.MAX)

    for call in forms.values():
        timed(call, 200)
    results = {(form, a): [] for form in forms for a in ARMS}
    for r in range(args.rounds):
        order = ARMS if r % 2 == 0 else tuple(reversed(ARMS))
        for form, call in forms.items():
            for a in order:
                arm(a)
                results[(form, a)].append(timed(call, args.calls))
    arm("all on")
    if hvd.rank() == 0:
        lines = [f"# benchmarks/observability_overhead.py, {hvd.size()} ranks, {args.rounds} rounds x {args.calls} "
                 f"calls, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load {'%.2f %.2f %.2f' % os.getloadavg()}"
                 f" on {os.cpu_count()} cores",
                 f"{'form':<18}{'arm':<14}{'median_us':>10}{'on-off_us':>11}{'spread':>8}"]
        for form in forms:
            on = results[(form, "all on")]
            for a in ARMS:
                times = results[(form, a)]
                diff = statistics.median([o - v for o, v in zip(on, times)]) if a != "all on" else 0.0
                lines.append(f"{form:<18}{a:<14}{statistics.median(times):>10.2f}{diff:>11.2f}"
                             f"{max(times) / min(times):>8.2f}")
        text = "\n".join(lines) + "\n"
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text)
    hvd.shutdown()


if __name__ == "__main__":
    sys.exit(main())
