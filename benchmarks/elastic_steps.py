"""Steady-state steps of an elastic job against the same job under plain `ringtrain-run`, same run, interleaved.

    python benchmarks/elastic_steps.py --workers 2 3 4 --repeats 2 --json out.json
    python benchmarks/elastic_steps.py --workers 3 --launches plain elastic elastic:no-drive --stalled-steps 10

Every job runs the same three loops on N workers (one thread each) and rank 0 times each iteration after a
warm-up: `model`, a training step of an MLP (784-1024-1024-10, 1.9 M parameters, Adam, batch 32: 7.6 MB of
gradients), the DistributedOptimizer's step as a job without an elastic state runs it; `model+lossless`, the step
through the TorchState's wrapper (lossless mode: the step counted for the step boundary the driver picks when
workers are added or removed -- a lock and an increment, no collective); `model+commit`, the plain step and the work of
commit() in roll-back mode (a copy of the model and optimizer state, then an allgather_object asking whether
workers came or went), as a Horovod-style loop does every step, in every launch alike; `allgather_obj`, that allgather alone; `4KB` and `1MB`, one synchronous
allreduce of that size; `1MB bcast`, a broadcast from rank 0. The launches:

  plain             ringtrain-run -np N: one MPI job (shared memory between the ranks)
  elastic           ringtrain-run -np N --min-np N: each worker its own MPI job, joined by the elastic driver; every
                    message goes through MPICH's network module (ofi, the driver's default)
  join              N separate `mpiexec -n 1` processes with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, joined
                    into one world at init() (torchrun style, launchers/join.py)

and suffixes: `:ofi` runs the job with MPIR_CVAR_CH4_NETMOD=ofi; `:no-drive` / `:drive` turn off / on, after init(),
the engine's MPI progress drive in waits and idle passes (`drives_mpi`, on in elastic worlds), to show what it
guards. A launch whose steps stall for the Watchdog's peer check (0.5 s) takes --stalled-steps per loop.

Each job also checks its results: every allreduce against the mean it must give, and at the end the model's
parameters against rank 0's (broadcast and compared bit for bit on every rank). The table gives, per worker count
and launch, the median and p90 over the timed steps of all its jobs, and the median's ratio to plain's.
"""
import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, source_commit, write_json  # noqa: E402
from elastic_recovery import mlp  # noqa: E402

LOOPS = ("model", "model+lossless", "model+commit", "allgather_obj", "4KB", "1MB", "1MB bcast")
LOOP_FLOATS = {"4KB": 1024, "1MB": 1 << 18, "1MB bcast": 1 << 18}
LAUNCHES = ("plain", "elastic", "join")
OPTIONS = ("ofi", "drive", "no-drive")


def worker(steps, warmup, drive):
    import torch

    import ringtrain.torch as hvd
    from ringtrain.core import state as core_state
    torch.set_num_threads(1)
    hvd.init()
    _, engine, config, _ = core_state._state
    if drive is not None:
        engine.control.drives_mpi = drive     # the benchmark's switch only: see the module docstring
    rank, size = hvd.rank(), hvd.size()
    model = mlp()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                                         named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, optimizer)
    torch.manual_seed(rank)
    x, y = torch.randn(32, 784), torch.randint(0, 10, (32,))
    wrong = 0

    times = {}
    for loop in LOOPS:
        inputs = [torch.full((LOOP_FLOATS.get(loop, 1),), rank + 1.0 + k) for k in range(3)]
        durations = []
        for i in range(warmup + steps):
            start = time.perf_counter()
            if loop.startswith("model"):
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                if loop == "model+lossless":    # the step as the state wraps it: counted for the boundary
                    optimizer.step()
                else:                           # the DistributedOptimizer's own step, as a job without a state
                    type(optimizer).step(optimizer)
                if loop == "model+commit":      # what commit() does in roll-back mode (Horovod's) every step
                    state.save()
                    hvd.allgather_object((rank, i))
            elif loop == "allgather_obj":
                got = hvd.allgather_object((rank, i))
            elif loop == "1MB bcast":
                got = hvd.broadcast(inputs[i % 3], root_rank=0, name=loop)
            else:
                got = hvd.allreduce(inputs[i % 3], name=loop)
            if i >= warmup:
                durations.append(time.perf_counter() - start)
            if loop == "allgather_obj":       # checked outside the timed step
                wrong += got != [(r, i) for r in range(size)]
            elif loop == "1MB bcast":
                wrong += not torch.equal(got, torch.full_like(got, 1.0 + i % 3))
            elif not loop.startswith("model"):
                wrong += not torch.allclose(got, torch.full_like(got, (size + 1) / 2 + i % 3))
        times[loop] = durations
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    unlike = int(not torch.equal(hvd.broadcast(flat.clone(), root_rank=0, name="check"), flat))
    unlike = int(hvd.allreduce(torch.tensor([float(unlike)]), op=hvd.Sum, name="unlike").item())
    wrong = int(hvd.allreduce(torch.tensor([float(wrong)]), op=hvd.Sum, name="wrong").item())
    if rank == 0:
        print("STEPS " + json.dumps({"size": size, "times": times, "wrong": wrong, "out_of_sync": unlike,
                                     "elastic": config.elastic, "drives_mpi": engine.control.drives_mpi}), flush=True)
    hvd.shutdown()


def split_launch(launch):
    """'join:ofi:no-drive' -> ('join', {'ofi', 'no-drive'}); raises ValueError on an unknown name."""
    kind, *options = launch.split(":")
    if kind not in LAUNCHES or not set(options) <= set(OPTIONS) or {"drive", "no-drive"} <= set(options):
        raise ValueError(f"unknown launch {launch!r}: one of {LAUNCHES}, with any of :{', :'.join(OPTIONS)}")
    return kind, set(options)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_job(n, launch, steps, warmup, timeout_s):
    """Rank 0's STEPS record of one job, or None (the reason printed)."""
    from ringtrain.launch import run
    kind, options = split_launch(launch)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if "ofi" in options:
        env["MPIR_CVAR_CH4_NETMOD"] = "ofi"
    script = [sys.executable, os.path.abspath(__file__), "--worker", "--steps", str(steps), "--warmup", str(warmup)]
    if options & {"drive", "no-drive"}:
        script += ["--drive", "0" if "no-drive" in options else "1"]
    if kind == "join":
        port = _free_port()
        procs = [subprocess.Popen([run.find_mpiexec(), "-n", "1"] + script, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                  env=dict(env, RANK=str(r), WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1",
                                           MASTER_PORT=str(port)))
                 for r in range(n)]
    else:
        cmd = [sys.executable, "-m", "ringtrain.launch.run", "-np", str(n)] + (["--min-np", str(n)] if kind == "elastic"
                                                                        else [])
        procs = [subprocess.Popen(cmd + script, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  start_new_session=True, env=env)]
    deadline, outputs, codes = time.monotonic() + timeout_s, [], []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
            out, _ = proc.communicate()
        outputs.append(out)
        codes.append(proc.returncode)
    text = "\n".join(outputs)
    found = re.search(r"^STEPS (\{.*\})$", text, re.M)
    if any(codes) or not found:
        print(f"{n} workers, {launch}: exit codes {codes}\n{text[-3000:]}", file=sys.stderr)
        return None
    return json.loads(found.group(1))


def p90(values):
    return statistics.quantiles(values, n=10)[-1] if len(values) > 1 else values[0]


def summarise(jobs):
    """{loop: {"median_ms", "p90_ms", "steps"}} over the pooled timed steps of a launch's jobs."""
    out = {}
    for loop in LOOPS:
        pooled = [t for job in jobs for t in job["times"][loop]]
        out[loop] = {"median_ms": 1e3 * statistics.median(pooled), "p90_ms": 1e3 * p90(pooled), "steps": len(pooled)}
    return out


def table(results, launches):
    lines = [f"{'workers':>7} {'launch':<18} {'loop':>12} {'median_ms':>10} {'p90_ms':>9} {'x plain':>8} "
             f"{'jobs':>4} {'failed':>6} {'wrong':>5} {'unsynced':>8}"]
    for n, by_launch in results.items():
        plain = by_launch.get("plain", {}).get("summary")
        for launch in launches:
            record = by_launch[launch]
            for loop in LOOPS:
                s = record["summary"].get(loop)
                if s is None:
                    lines.append(f"{n:>7} {launch:<18} {loop:>12} {'every job failed':>29}")
                    continue
                ratio = (f"{s['median_ms'] / plain[loop]['median_ms']:>8.2f}" if plain and loop in plain
                         else f"{'-':>8}")
                lines.append(f"{n:>7} {launch:<18} {loop:>12} {s['median_ms']:>10.3f} {s['p90_ms']:>9.3f} {ratio} "
                             f"{len(record['jobs']):>4} {record['failed']:>6} {record['wrong']:>5} "
                             f"{record['out_of_sync']:>8}")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--launches", nargs="+", default=["plain", "elastic"],
                        help="plain, elastic, join, each with optional :ofi, :drive or :no-drive")
    parser.add_argument("--repeats", type=int, default=2, help="jobs per launch and worker count, interleaved")
    parser.add_argument("--steps", type=int, default=60, help="timed iterations per loop")
    parser.add_argument("--stalled-steps", type=int, default=10, help="timed iterations per loop of :no-drive")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--job-timeout", type=int, default=180)
    parser.add_argument("--json")
    parser.add_argument("--out", help="also write the table here, between lines giving the command, the start and "
                                      "end times, the load and the commit")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--drive", type=int, choices=(0, 1), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.steps, args.warmup, None if args.drive is None else bool(args.drive))
    for launch in args.launches:
        split_launch(launch)
    header = [f"# steady-state steps: plain ringtrain-run vs {', '.join(args.launches[1:]) or 'nothing'}; loops: "
              f"{', '.join(LOOPS)}; same run, jobs interleaved",
              f"# {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC start, {os.cpu_count()} cores "
              f"(load {_load()}), commit {source_commit()}",
              "# python benchmarks/elastic_steps.py " + " ".join(sys.argv[1:])]
    results = {}
    for n in args.workers:
        jobs = {launch: [] for launch in args.launches}
        for repeat in range(args.repeats):      # interleaved: forward, then backward (ABBA)
            for launch in (args.launches if repeat % 2 == 0 else args.launches[::-1]):
                steps = args.stalled_steps if "no-drive" in split_launch(launch)[1] else args.steps
                jobs[launch].append(one_job(n, launch, steps, args.warmup, args.job_timeout))
        results[n] = {}
        for launch, runs in jobs.items():
            done = [r for r in runs if r is not None]
            results[n][launch] = {"jobs": done, "failed": len(runs) - len(done),
                                  "wrong": sum(r["wrong"] for r in done),
                                  "out_of_sync": sum(r["out_of_sync"] for r in done),
                                  "summary": summarise(done) if done else {}}
        print(table({n: results[n]}, args.launches).split("\n", 1 if n != args.workers[0] else 0)[-1], flush=True)
    if args.json:
        write_json(args.json, {"machine": machine_info(), "args": vars(args), "loops": LOOPS, "workers": results})
    if args.out:
        footer = f"# {time.strftime('%H:%M:%S', time.gmtime())} UTC end (load {_load()})"
        with open(args.out, "w") as f:
            f.write("\n".join(header + [table(results, args.launches), footer]) + "\n")
    bad = sum(r["failed"] + r["wrong"] + r["out_of_sync"] for by in results.values() for r in by.values())
    return 1 if bad else 0


def _load():
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


if __name__ == "__main__":
    sys.exit(main())
