"""Sharded optimizer vs DistributedOptimizer vs torch's ZeroRedundancyOptimizer + DDP: memory per rank and step time.

    python benchmarks/sharded_optimizer.py --ranks 2,4 --json benchmarks/results/sharded_optimizer.json \
        --png benchmarks/results/sharded_optimizer.png [--quick]

The script launches one `mpiexec -n N` job per (mode, N) (do not start it under mpiexec yourself), so every mode
starts from a fresh process and its memory high-water mark is its own. The model is one where Adam's state
dominates: a stack of square Linear layers (default 6 x 4096^2 = 100.7 M float32 parameters, 403 MB; Adam keeps
two moments, 806 MB). Modes, each with torch.optim.Adam:
  distributed-optimizer   ringtrain.torch.DistributedOptimizer (every rank holds the whole state)
  shard-optimizer         DistributedOptimizer(shard="optimizer"): ZeRO stage 1
  shard-gradients         DistributedOptimizer(shard="gradients"): ZeRO stage 2 (reducescatter during backward)
  shard-gradients-after-backward   the same with overlap=False: buckets reduce-scattered in step(), after backward
  torch-zero-ddp          torch DistributedDataParallel (gloo, gradient_as_bucket_view) + ZeroRedundancyOptimizer
Per rank it records the median step time (zero_grad, forward, backward, step) over --steps steps after --warmup,
the optimizer state it holds (bytes of its state tensors, exact), the gradient memory it holds after backward
(distinct storages of .grad and of the optimizer's own gradient buffers), and the process's peak resident memory
(VmHWM, reset after the model is built, so it is what training adds on top of the model, libraries included).
Correctness: the final parameters of every mode must equal DistributedOptimizer's to float tolerance (recorded).
x_DO and x_ZeRO: step time over DistributedOptimizer's and over ZeroRedundancyOptimizer + DDP's, same run.
--fused gives every mode's Adam fused=True. --merge a.json b.json prints one table from runs split by rank count or
round (each run under ~10 minutes on a shared machine).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import common

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)
sys.path.append(REPO_ROOT)   # run from a source checkout without pip install

MODES = ("distributed-optimizer", "shard-optimizer", "shard-gradients", "shard-gradients-after-backward",
         "torch-zero-ddp")
SHARD_OF_MODE = {"shard-optimizer": "optimizer", "shard-gradients": "gradients",
                 "shard-gradients-after-backward": "gradients"}
# the optimizer's own choice (overlap=None) except where the mode names the schedule
OVERLAP_OF_MODE = {"shard-gradients-after-backward": False}


# ---------------------------------------------------------------- one job: one mode at N ranks

def _status_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak_rss():
    """Linux: writing 5 to clear_refs resets VmHWM to the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _state_bytes(state):
    return sum(v.numel() * v.element_size() for entry in state.values() for v in entry.values()
               if hasattr(v, "dim") and v.dim() > 0)


def _storage_bytes(tensors):
    seen = {}
    for t in tensors:
        if t is not None:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def run_job(args):
    import torch
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    import ringtrain.torch as hvd
    hvd.init()
    torch.manual_seed(0)
    layers = []
    for _ in range(args.depth):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers)
    generator = torch.Generator().manual_seed(1)
    batch = [(torch.randn(args.batch * size, args.width, generator=generator),
              torch.randn(args.batch * size, args.width, generator=generator)) for _ in range(2)]
    rows = slice(rank * args.batch, (rank + 1) * args.batch)
    params = sum(p.numel() for p in model.parameters())
    mode = args.mode
    adam_options = {"fused": True} if args.fused else {}
    inner_state = None
    if mode == "torch-zero-ddp":
        import allreduce   # sibling benchmark: the env:// rendezvous helper
        from torch.distributed.optim import ZeroRedundancyOptimizer
        allreduce.init_torch_distributed(comm, "gloo")
        trained = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-4,
                                            **adam_options)
        inner_state = lambda: optimizer.optim.state                      # noqa: E731
        grad_buffers = lambda: []                                        # noqa: E731
    else:
        trained = model
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, **adam_options)
        if mode in SHARD_OF_MODE:
            optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                                 shard=SHARD_OF_MODE[mode], overlap=OVERLAP_OF_MODE.get(mode))
            sharding = optimizer._ringtrain
            inner_state = lambda: sharding.update.inner.state            # noqa: E731
            grad_buffers = lambda: [v.grad for v in sharding.update.views] + [   # noqa: E731
                b.buffer for b in getattr(sharding.gradients, "hooks", None).reducer.buckets
                if b.buffer is not None] if sharding.stage == 1 else [v.grad for v in sharding.update.views]
        else:
            optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
            inner_state = lambda: optimizer.state                        # noqa: E731
            grad_buffers = lambda: []                                    # noqa: E731
    rss_model_mb = _status_kb("VmRSS") / 1024
    times, grad_bytes = [], 0
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            comm.Barrier()
            _reset_peak_rss()
        x, y = batch[step % 2]
        start = time.perf_counter()
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(trained(x[rows]), y[rows]).backward()
        if mode in SHARD_OF_MODE:
            optimizer.synchronize()     # (step() would; done here so the gradients it holds can be counted)
        grad_bytes = max(grad_bytes, _storage_bytes([p.grad for p in model.parameters()] + grad_buffers()))
        optimizer.step()
        times.append(time.perf_counter() - start)
    peak_rss_mb = _status_kb("VmHWM") / 1024
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = comm.gather(dict(rank=rank, step_s=times[args.warmup:], state_bytes=_state_bytes(inner_state()),
                                grad_bytes=grad_bytes, peak_rss_mb=peak_rss_mb, rss_model_mb=rss_model_mb,
                                checksum=float(flat.double().sum()), head=flat[:1000].tolist()), root=0)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(dict(mode=mode, ranks=size, params=params, per_rank=everyone), f)
    if mode == "torch-zero-ddp":
        torch.distributed.destroy_process_group()
    hvd.shutdown()


# ---------------------------------------------------------------- driver

def summarize(job, reference):
    per_rank = job["per_rank"]
    steps = sorted(s for r in per_rank for s in r["step_s"])
    record = dict(mode=job["mode"], ranks=job["ranks"], params=job["params"],
                  step_s=common.median([common.median(r["step_s"]) for r in per_rank]),
                  state_mb=max(r["state_bytes"] for r in per_rank) / 2 ** 20,
                  grad_mb=max(r["grad_bytes"] for r in per_rank) / 2 ** 20,
                  peak_rss_mb=max(r["peak_rss_mb"] for r in per_rank),
                  rss_model_mb=max(r["rss_model_mb"] for r in per_rank),
                  step_s_min=steps[0], step_s_max=steps[-1])
    if reference is not None:
        head, want = per_rank[0]["head"], reference["per_rank"][0]["head"]
        record["max_diff_vs_distributed_optimizer"] = max(abs(a - b) for a, b in zip(head, want))
        record["checksum_rel_diff"] = abs(per_rank[0]["checksum"] - reference["per_rank"][0]["checksum"]) / max(
            1e-12, abs(reference["per_rank"][0]["checksum"]))
    record["ranks_agree"] = len({tuple(r["head"]) for r in per_rank}) == 1
    return record


def table(records):
    rows = []
    for r in records:
        base = next(b for b in records if b["ranks"] == r["ranks"] and b["mode"] == "distributed-optimizer")
        zero = next((b for b in records if b["ranks"] == r["ranks"] and b["mode"] == "torch-zero-ddp"), None)
        rows.append([r["ranks"], r["mode"], f"{r['step_s'] * 1e3:.0f}", f"{r['step_s'] / base['step_s']:.2f}",
                     f"{r['step_s'] / zero['step_s']:.2f}" if zero else "-",
                     f"{r['state_mb']:.0f}", f"{r['state_mb'] / base['state_mb']:.3f}", f"{r['grad_mb']:.0f}",
                     f"{r['peak_rss_mb'] - r['rss_model_mb']:.0f}", f"{r['peak_rss_mb']:.0f}",
                     f"{r.get('max_diff_vs_distributed_optimizer', 0.0):.1e}", r["ranks_agree"]])
    return common.format_table(
        ["ranks", "mode", "step_ms", "x_DO", "x_ZeRO", "state_MB", "state_x_DO", "grad_MB", "added_peak_RSS_MB",
         "peak_RSS_MB",
         "max_diff", "in_sync"], rows,
        title="per rank: median step time, optimizer state, gradients held after backward, peak RSS")


def rounds_lines(records):
    """Each mode's step time per round: on a shared machine one round can differ from the next by 2x."""
    return "\n".join(f"# {r['ranks']} ranks {r['mode']}: step time per round "
                     f"{[round(t, 3) for t in r.get('rounds_step_s', [r['step_s']])]} s" for r in records)


def plot(records, path):
    plt = common.pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    modes = [m for m in MODES if any(r["mode"] == m for r in records)]
    ranks = sorted({r["ranks"] for r in records})
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        xs = [k + i * width for k in range(len(ranks))]
        by_rank = {r["ranks"]: r for r in records if r["mode"] == mode}
        left.bar(xs, [by_rank[n]["step_s"] * 1e3 if n in by_rank else 0 for n in ranks], width, label=mode)
        right.bar(xs, [by_rank[n]["state_mb"] + by_rank[n]["grad_mb"] if n in by_rank else 0 for n in ranks],
                  width, label=mode)
    for ax, label in ((left, "step time per rank (ms)"), (right, "optimizer state + gradients per rank (MB)")):
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(ranks))], [f"{n} ranks" for n in ranks])
        ax.set_ylabel(label)
        ax.grid(True, axis="y", alpha=0.3)
    left.legend(fontsize=8)
    fig.suptitle(f"Adam on {records[0]['params'] / 1e6:.1f} M parameters")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch", type=int, default=16, help="rows per rank per step")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--first-round", type=int, default=0,
                        help="number of the first round (rounds alternate the order of the modes): a run split "
                             "into one round per run keeps alternating")
    parser.add_argument("--json")
    parser.add_argument("--png")
    parser.add_argument("--fused", action="store_true",
                        help="every mode's Adam with fused=True (torch's one-kernel update; without it torch steps "
                             "CPU tensors one operation at a time, and the sharded modes pick the fused kernel for "
                             "their shard themselves)")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="print (and --json/--png) one table from the rounds of earlier runs' JSON files, e.g. "
                             "one file per rank count or per round")
    parser.add_argument("--quick", action="store_true", help="a small model, 2 ranks, 2 steps: checks it runs")
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        return run_job(args)
    if args.merge:
        return merge_files(args)
    if args.quick:
        args.width, args.depth, args.batch, args.warmup, args.steps, args.ranks, args.rounds = 256, 3, 4, 1, 2, "2", 1
    records = []
    load_at_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="ringtrain-sharded-bench-") as scratch:
        for n in [int(v) for v in args.ranks.split(",")]:
            rounds = []
            for round_number in range(args.first_round, args.first_round + args.rounds):
                jobs = run_round(args, n, scratch, round_number)
                reference = jobs.get("distributed-optimizer")
                rounds.append([summarize(job, reference if mode != "distributed-optimizer" else None)
                               for mode, job in jobs.items()])
            records += merge_rounds(rounds)
    print(f"# benchmarks/sharded_optimizer.py {' '.join(sys.argv[1:])}\n# commit {common.source_commit()}, "
          f"{time.strftime('%Y-%m-%d %H:%M %z')}, load average at the start {load_at_start:.1f}, at the end "
          f"{os.getloadavg()[0]:.1f}")
    print(table(records))
    print(rounds_lines(records))
    if args.json:
        common.write_json(args.json, dict(machine=common.machine_info(), args=vars(args), records=records))
    if args.png:
        plot(records, args.png)
    return 0


def merge_rounds(rounds):
    """Per mode: the median over rounds of every number (modes take turns within a round, so machine noise hits
    them alike); the step times of each round kept."""
    merged = []
    for i, first in enumerate(rounds[0]):
        same = [r[i] for r in rounds]
        record = dict(first)
        for key, value in first.items():
            if isinstance(value, float):
                record[key] = common.median([r[key] for r in same])
        record["ranks_agree"] = all(r["ranks_agree"] for r in same)
        record["rounds_step_s"] = [r["step_s"] for r in same]
        record["rounds"] = same           # what merge_files() merges again
        merged.append(record)
    return merged


def merge_files(args):
    """One table from several runs: each (ranks, mode)'s rounds from every file, merged as one run's rounds (every
    file holds whole rounds, all modes taking turns, so the ratios of one rank count stay same-run ratios)."""
    by_key, sources = {}, []
    for path in args.merge:
        with open(path) as f:
            run = json.load(f)
        sources.append((path, run))
        for record in run["records"]:
            rounds = [dict(r, source=path) for r in record.get("rounds", [record])]
            by_key.setdefault((record["ranks"], record["mode"]), []).extend(rounds)
    counts = {len(rounds) for rounds in by_key.values()}
    if len(counts) != 1:
        raise SystemExit(f"the files hold different numbers of rounds per mode: {sorted(counts)}")
    keys = sorted(by_key, key=lambda k: (k[0], MODES.index(k[1]) if k[1] in MODES else len(MODES)))
    count = counts.pop()
    records = merge_rounds([[by_key[k][i] for k in keys] for i in range(count)])
    print(f"# benchmarks/sharded_optimizer.py --merge: {count} rounds per mode from")
    for path, run in sources:
        options = " ".join(f"--{k} {run['args'][k]}" for k in ("ranks", "rounds") if k in run["args"])
        print(f"#   {os.path.basename(path)}: {options}{' --fused' if run['args'].get('fused') else ''}")
    print(table(records))
    print(rounds_lines(records))
    if args.json:
        common.write_json(args.json, dict(machine=common.machine_info(), args=vars(args), sources=args.merge,
                                          records=records))
    if args.png:
        plot(records, args.png)
    return 0


def run_round(args, n, scratch, round_number):
    """One mpiexec job per mode at n ranks; returns mode -> the job's JSON."""
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    jobs = {}
    modes = args.modes.split(",")
    if round_number % 2:
        modes = modes[::-1]          # alternate the order, so no mode always runs first after a pause
    for mode in modes:
        out = os.path.join(scratch, f"{mode}-{n}.json")
        command = [mpiexec, "-n", str(n), sys.executable, os.path.abspath(__file__), "--job", "--mode", mode,
                   "--out", out, "--width", str(args.width), "--depth", str(args.depth),
                   "--batch", str(args.batch), "--warmup", str(args.warmup), "--steps", str(args.steps)]
        if args.fused:
            command.append("--fused")
        env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // n)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, BENCH_DIR, env.get("PYTHONPATH")) if p)
        subprocess.run(command, check=True, env=env, timeout=1800)
        with open(out) as f:
            jobs[mode] = json.load(f)
        print(f"{n} ranks {mode} round {round_number + 1}: done", flush=True)
    return {mode: jobs[mode] for mode in args.modes.split(",")}


if __name__ == "__main__":
    sys.exit(main())
