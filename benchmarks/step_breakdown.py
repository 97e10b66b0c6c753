"""Where a synchronous training step's time goes, against lockstep: the same step with one MPI barrier in place of
the gradient allreduce (no gradient traffic) -- what every synchronous method pays, and nothing more.

    mpiexec -n 2 python benchmarks/step_breakdown.py [--model convnet|mlp] [--rounds 3] [--steps 15]
        [--modes no-comm,lockstep,after-backward,overlap] [--json out.json]

Modes, interleaved in rounds (a fresh model and optimizer per mode and round, the medians over rounds reported):
  no-comm         plain torch, no synchronisation at all (the ranks drift apart): does the computation itself run
                  slower when the ranks run in step (shared caches, memory bandwidth)? compare its fwd+bwd cpu
  lockstep        plain torch optimizer; after backward an MPI barrier (the synchronous ceiling)
  after-backward  ringtrain.torch.DistributedOptimizer(overlap=False): synchronize() reduces after backward
  overlap         DistributedOptimizer(overlap=True): buckets are reduced from hooks during backward
No barrier between steps: each step has exactly one synchronisation point, as in training. Per step and rank:
  fwd+bwd         zero_grad + forward + backward (wall; cpu = this thread's CPU time, which excludes time the OS
                  gave to other processes, so cpu < wall means the rank was descheduled)
  wait            until the last rank finished its fwd+bwd (0 on the slowest rank): the ranks' imbalance
  after_last      from the last rank's end of backward until this rank leaves synchronize() / the barrier: the
                  communication that nothing hides, plus the time to notice it ended (wake-up)
  step            the wrapped optimizer's step()
  engine_cpu      CPU time of ringtrain's engine thread per step (it runs the allreduces of overlap; otherwise it
                  only polls)
  faults          minor page faults per step, all threads: fresh pages touched (allocator churn costs ms on a VM)
wait and after_last compare perf_counter() stamps of different processes: valid on one host only (all ranks of the
job on one node; otherwise they are left out). On a machine shared with other work, compare modes within one run.
"""
import argparse
import json
import os
import resource
import sys
import threading
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
MODES = ("no-comm", "lockstep", "after-backward", "overlap")
LOCAL_MODES = ("no-comm", "lockstep")   # the plain torch optimizer, no gradient traffic
PHASES = ("step_wall", "fwd_bwd", "fwd_bwd_cpu", "wait", "after_last", "step", "engine_cpu", "faults")


def engine_cpu_clock():
    """A function returning the CPU seconds of ringtrain's engine thread so far (None if it cannot be found)."""
    threads = [t for t in threading.enumerate() if t.name == "ringtrain-engine"]
    if not threads or not hasattr(time, "pthread_getcpuclockid"):
        return lambda: None
    clock = time.pthread_getcpuclockid(threads[0].ident)
    return lambda: time.clock_gettime(clock)


def minor_faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def run_mode(mode, args, round_index, comm, inputs, labels, engine_cpu):
    """Stamps of every measured step on this rank: (t0, backward_end, synchronized, stepped, cpu phases...)."""
    torch.manual_seed(0)
    model = train_scaling.build_model(torch, args.model, args.width)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if mode not in LOCAL_MODES:
        named = [(f"r{round_index}.{mode}.{name}", p) for name, p in model.named_parameters()]
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=named, overlap=(mode == "overlap"))
    loss_fn = torch.nn.CrossEntropyLoss()
    stamps = []
    comm.Barrier()
    for i in range(WARMUP + args.steps):
        faults, engine0 = minor_faults(), engine_cpu()
        t0, c0 = time.perf_counter(), time.thread_time()
        optimizer.zero_grad()
        loss_fn(model(inputs), labels).backward()
        t1, c1 = time.perf_counter(), time.thread_time()
        if mode == "lockstep":
            comm.Barrier()
        elif mode != "no-comm":
            optimizer.synchronize()
        t2 = time.perf_counter()
        if mode in LOCAL_MODES:
            optimizer.step()
        else:
            with optimizer.skip_synchronize():
                optimizer.step()
        t3 = time.perf_counter()
        engine1 = engine_cpu()
        if i >= WARMUP:
            stamps.append((t0, t1, t2, t3, c1 - c0,
                           None if engine0 is None else engine1 - engine0, minor_faults() - faults))
    return stamps


def phases(everyone, one_host):
    """Per-phase medians (ms, mean over ranks of each rank's median) from every rank's stamps of one mode/round."""
    a = np.array([[row[:5] for row in rank] for rank in everyone], dtype=float)     # ranks x steps x 5
    steps = a.shape[1]
    last_arrival = a[:, :, 1].max(axis=0)
    result = {
        "step_wall": 1e3 * (a[:, -1, 3].max() - a[:, 0, 0].min()) / steps,
        "fwd_bwd": 1e3 * np.median(a[:, :, 1] - a[:, :, 0], axis=1).mean(),
        "fwd_bwd_cpu": 1e3 * np.median(a[:, :, 4], axis=1).mean(),
        "step": 1e3 * np.median(a[:, :, 3] - a[:, :, 2], axis=1).mean(),
        "wait": 1e3 * np.median(last_arrival - a[:, :, 1], axis=1).mean() if one_host else None,
        "after_last": 1e3 * np.median(a[:, :, 2] - last_arrival, axis=1).mean() if one_host else None,
        "faults": float(np.mean([np.median([row[6] for row in rank]) for rank in everyone])),
    }
    engine = [[row[5] for row in rank] for rank in everyone]
    result["engine_cpu"] = (None if any(v is None for rank in engine for v in rank)
                            else 1e3 * float(np.mean([np.median(rank) for rank in engine])))
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="convnet", choices=train_scaling.MODELS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--json")
    args = parser.parse_args()
    modes = args.modes.split(",")
    unknown = set(modes) - set(MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; choose from {list(MODES)}")
    args.width = 64 if args.model == "convnet" else 54
    torch.set_num_threads(1)
    hvd.init()
    comm = MPI.COMM_WORLD
    one_host = hvd.local_size() == hvd.size()
    inputs, labels = train_scaling.synthetic_batch(torch, args.model, args.width, hvd.rank(), args.batch)
    engine_cpu = engine_cpu_clock()
    load_before = os.getloadavg()[0]
    measured = {mode: [] for mode in modes}
    for round_index in range(args.rounds):
        for mode in modes:
            everyone = comm.gather(run_mode(mode, args, round_index, comm, inputs, labels, engine_cpu), root=0)
            if hvd.rank() == 0:
                # free-running ranks have no common step to wait for
                measured[mode].append(phases(everyone, one_host and mode != "no-comm"))
    if hvd.rank() == 0:
        report(args, modes, measured, one_host, load_before)
    hvd.shutdown()


def report(args, modes, measured, one_host, load_before):
    summary = {}
    for mode in modes:
        summary[mode] = {}
        for phase in PHASES:
            values = [r[phase] for r in measured[mode] if r[phase] is not None]
            summary[mode][phase] = float(np.median(values)) if values else None
        walls = [r["step_wall"] for r in measured[mode]]
        summary[mode]["step_wall_range"] = [min(walls), max(walls)]
    machine = train_scaling.common.machine_info()
    print(f"# ringtrain {machine['commit']}, {machine['date']}")
    print(f"# {args.model}, {hvd.size()} ranks, batch {args.batch}, 1 thread per rank, transport "
          f"{ringtrain.transport_name()}; ms per step, median over {args.rounds} interleaved rounds of "
          f"{args.steps} steps (each: mean over ranks of the rank's median); load average {load_before:.2f} at "
          f"start, {os.getloadavg()[0]:.2f} at end" + ("" if one_host else "; ranks on several hosts: no wait, "
                                                        "after_last"))
    header = ["mode", "step", "(range)", "fwd+bwd", "(cpu)", "wait", "after_last", "opt.step", "engine_cpu",
              "faults"]
    rows = []
    for mode in modes:
        s = summary[mode]
        rows.append([mode, _ms(s["step_wall"]), f"{s['step_wall_range'][0]:.1f}-{s['step_wall_range'][1]:.1f}",
                     _ms(s["fwd_bwd"]), _ms(s["fwd_bwd_cpu"]), _ms(s["wait"]), _ms(s["after_last"]),
                     _ms(s["step"]), _ms(s["engine_cpu"]), f"{s['faults']:.0f}"])
    print(train_scaling.common.format_table(header, rows))
    if "lockstep" in summary:
        base = summary["lockstep"]
        for mode in modes:
            if mode in LOCAL_MODES:
                continue
            s = summary[mode]
            parts = ", ".join(f"{name} {s[key] - base[key]:+.1f}" for name, key in
                              (("fwd+bwd", "fwd_bwd"), ("wait", "wait"), ("after_last", "after_last"),
                               ("opt.step", "step")) if s[key] is not None and base[key] is not None)
            print(f"# {mode} against lockstep: step {s['step_wall'] - base['step_wall']:+.1f} ms ({parts})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "model": args.model, "ranks": hvd.size(), "rounds": args.rounds, "steps": args.steps,
                       "load_average_start_end": [load_before, os.getloadavg()[0]], "one_host": one_host,
                       "summary": summary, "per_round": measured}, f, indent=1)


def _ms(value):
    return "-" if value is None else f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"


if __name__ == "__main__":
    main()
