"""The worked examples of docs/guides/observability.md, run for real: their output is the results file the guide
quotes.

    python benchmarks/observability_demo.py --out benchmarks/results/observability_example.txt

1. A slow rank: 3 ranks train a small MLP with DistributedOptimizer; rank 2's data loader takes 30 ms longer each
   step. Rank 0 logs the straggler line, and every rank's hvd.straggler_report() names rank 2.
2. A hang explained: rank 2 has no validation batch and skips the validation loss allreduce that ranks 0 and 1 call.
   The stall ends with StallError, every rank writes its flight recorder, and ringtrain-run prints the merged report.

Each scenario is a `ringtrain-run -np 3` job of this same file (--worker slow | skip).
"""
import argparse
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker_slow():
    import torch
    import ringtrain.torch as hvd
    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(150):
        time.sleep(0.01 + (0.03 if hvd.rank() == 2 else 0.0))     # the data loader; rank 2's is slower
        x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    report = hvd.straggler_report()
    if hvd.rank() == 0:
        print("hvd.straggler_report() on rank 0:")
        print(f"  stragglers: {report['stragglers']} (window {report['window_s']:.1f} s)")
        for entry in report["ranks"]:
            print(f"  rank {entry['rank']}: the others waited {entry['waited_s']:.2f} s for it in total "
                  f"({entry['waits']} waits); last window {entry['window_share']:.0%}, "
                  f"{entry['window_mean_ms']:.1f} ms a wait")
    hvd.shutdown()


def worker_skip():
    import torch
    import ringtrain.torch as hvd
    torch.set_num_threads(1)
    hvd.init()
    model = torch.nn.Linear(16, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    for step in range(5):
        opt.zero_grad()
        model(torch.randn(8, 16)).sum().backward()
        opt.step()
        if step == 3:
            if hvd.rank() != 2:                  # the bug: rank 2 has no validation batch, so it skips the metric
                hvd.allreduce(torch.tensor(0.5), name="val.loss")
            else:
                time.sleep(0.5)                  # rank 2 goes on with its next step
    hvd.shutdown()


def run_job(scenario, env):
    cmd = [sys.executable, "-m", "ringtrain.launch.run", "-np", "3", sys.executable,
           os.path.abspath(__file__), "--worker", scenario]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", choices=("slow", "skip"))
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.worker == "slow":
        return worker_slow()
    if args.worker == "skip":
        return worker_skip()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [
        REPO, os.environ.get("PYTHONPATH")])))
    sections = [f"# benchmarks/observability_demo.py, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
                f"load {'%.2f %.2f %.2f' % os.getloadavg()} on {os.cpu_count()} cores"]
    slow_env = dict(env, RINGTRAIN_STRAGGLER_WINDOW_S="2")
    code, out = run_job("slow", slow_env)
    sections += ["", "## 1. a slow rank: RINGTRAIN_STRAGGLER_WINDOW_S=2 ringtrain-run -np 3 python train.py",
                 f"(exit status {code})", out.rstrip()]
    skip_env = dict(env, RINGTRAIN_STALL_WARNING_S="2", RINGTRAIN_STALL_TIMEOUT_S="5",
                    RINGTRAIN_FLIGHT_RECORDER_DIR="/tmp/ringtrain-flight")
    code, out = run_job("skip", skip_env)
    sections += ["", "## 2. a hang explained: RINGTRAIN_STALL_TIMEOUT_S=5 RINGTRAIN_FLIGHT_RECORDER_DIR=/tmp/ringtrain-flight "
                 "ringtrain-run -np 3 python train.py", f"(exit status {code})", out.rstrip()]
    text = "\n".join(sections) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
