"""Recovery time of an elastic job: from a worker's SIGKILL to the first completed step of the new world.

    python benchmarks/elastic_recovery.py --workers 2 3 4 --repeats 5 --json out.json
    python benchmarks/elastic_recovery.py --mode rollback ...      # Horovod's roll-back, a commit every step

For each N, `ringtrain-run -np N --min-np N-1` trains an MLP (784-1024-1024-10, 1.9 M parameters, Adam); in its
10th step the last rank SIGKILLs itself. --mode lossless (the default): no commit, the survivors go on from the
furthest step; rollback: hvd.elastic.run(rollback=True) with a commit every step. The survivors' rank 0 reports four phases (wall clock,
one machine):
  detection     SIGKILL -> the survivor's collective raised (the driver saw the worker's connection close and
                told the survivors, whose waits end at once)
  re-formation  -> the new world is up: (rollback: roll back to the commit), abandon the dead world, the driver's rendezvous
                (Open_port / Connect / Accept + Merge), ringtrain.init on it (topology, transports, engine) and
                the reset callbacks
  state sync    -> sync(): (lossless: the step counts allgathered) the source rank's parameters, optimizer state
                and object state broadcast
  first step    -> the first training step of the new world completed (its allreduces included)
The table gives the median over the jobs that recovered, the total's min and max, and how many of --repeats jobs
did not recover (within --job-timeout seconds). Workers use one thread each.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

PHASES = ("detection", "reformation", "sync", "first_step")
KILL_STEP = 10
STEPS = 25


def mlp():
    """The benchmark's model, seeded: 784-1024-1024-10, 1.9 M parameters (7.6 MB of float32 gradients)."""
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(784, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                               torch.nn.ReLU(), torch.nn.Linear(1024, 10))


def worker():
    import torch

    import ringtrain.torch as hvd
    from ringtrain.elastic import runner
    torch.set_num_threads(1)
    hvd.init()
    model = mlp()
    optimizer = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                                         named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, optimizer, step=0, first_size=hvd.size())
    x, y = torch.randn(32, 784), torch.randint(0, 10, (32,))

    rollback = os.environ.get("RECOVERY_MODE") == "rollback"

    @hvd.elastic.run(rollback=rollback)
    def train(state):
        recovered = "error" in runner.last_recovery
        while state.step < STEPS:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            if hvd.size() == state.first_size and hvd.rank() == hvd.size() - 1 and state.step == KILL_STEP:
                print(f"KILL {time.time():.6f}", flush=True)
                os.kill(os.getpid(), 9)
            optimizer.step()
            if recovered and hvd.rank() == 0:
                times = dict(runner.last_recovery, first_step=time.time())
                print("RECOVERY " + json.dumps(times), flush=True)
                recovered = False
            state.step += 1
            if rollback:
                state.commit()

    train(state)


def one_job(n, timeout_s, mode):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", RECOVERY_MODE=mode)
    cmd = [sys.executable, "-m", "ringtrain.launch.run", "-np", str(n), "--min-np", str(n - 1),
           sys.executable, os.path.abspath(__file__), "--worker"]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as expired:       # the workers die with the driver (PR_SET_PDEATHSIG)
        print(f"{n} workers: no recovery within {timeout_s} s:\n{(expired.stdout or b'')[-3000:]}\n"
              f"{(expired.stderr or b'')[-3000:]}", file=sys.stderr)
        return None
    kill = re.search(r"^KILL ([\d.]+)$", done.stdout, re.M)
    recovery = re.search(r"^RECOVERY (\{.*\})$", done.stdout, re.M)
    if done.returncode != 0 or not kill or not recovery:
        print(f"{n} workers: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}", file=sys.stderr)
        return None
    t = json.loads(recovery.group(1))
    t_kill = float(kill.group(1))
    return {"detection": t["error"] - t_kill, "reformation": t["reformed"] - t["error"],
            "sync": t["synced"] - t["reformed"], "first_step": t["first_step"] - t["synced"],
            "total": t["first_step"] - t_kill}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json")
    parser.add_argument("--job-timeout", type=int, default=60, help="a job not done by then counts as failed")
    parser.add_argument("--mode", choices=("lossless", "rollback"), default="lossless")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker()
    results = {}
    header = f"{'workers':>7} {'detection_s':>11} {'reform_s':>9} {'sync_s':>7} {'first_step_s':>12} " \
             f"{'total_s':>8} {'min_s':>6} {'max_s':>6} {'failed':>6}  (median of the jobs that recovered)"
    print(header, flush=True)
    for n in args.workers:
        runs = [one_job(n, args.job_timeout, args.mode) for _ in range(args.repeats)]
        failed = sum(r is None for r in runs)
        runs = [r for r in runs if r is not None]
        if not runs:
            print(f"{n:>7} every job failed")
            continue
        median = {k: statistics.median(r[k] for r in runs) for k in PHASES + ("total",)}
        totals = [r["total"] for r in runs]
        results[n] = {"runs": runs, "median": median, "failed": failed}
        print(f"{n:>7} {median['detection']:>11.3f} {median['reformation']:>9.3f} {median['sync']:>7.3f} "
              f"{median['first_step']:>12.3f} {median['total']:>8.3f} {min(totals):>6.2f} {max(totals):>6.2f} "
              f"{failed:>6}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workers": results, "kill_step": KILL_STEP, "mode": args.mode, "machine_cores": os.cpu_count(),
                       "date": time.strftime("%Y-%m-%d")}, f, indent=1)


if __name__ == "__main__":
    main()
