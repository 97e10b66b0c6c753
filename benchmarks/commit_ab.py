"""Same-run A/B of two commits: the benchmark of each, jobs interleaved old/new/new/old, medians compared.

A speed claim about a change ("within run-to-run noise of the code before it") needs both versions measured on the
same machine in the same minutes: load on a shared machine moves these numbers by more than most changes do. This
script checks both commits out into temporary worktrees, runs each one's own benchmark script from its own checkout
(so every job measures exactly the code of its commit), alternates the arms in ABBA order so a slow drift in load
falls on both equally, and prints one table of medians over jobs with the new/old ratio and the spread.

    python benchmarks/commit_ab.py --old d1cbbab --new HEAD --bench allreduce --ranks 2 --jobs 4 \\
        --out benchmarks/results --prefix engine_ab -- --min-bytes 4096 --max-bytes 67108864
    python benchmarks/commit_ab.py --old d1cbbab --new HEAD --bench train --jobs 2 \\
        --out benchmarks/results --prefix engine_ab -- --max-ranks 2 --rounds 2
    python benchmarks/commit_ab.py --old d1cbbab --new HEAD --bench step_breakdown --ranks 2 --jobs 3 \\
        --out benchmarks/results --prefix mlp_ab -- --model mlp --modes lockstep,after-backward --rounds 5

Arguments after `--` go to the benchmark script unchanged. Every job's JSON and text output is kept under --out as
<prefix>_<bench>_<ranks>ranks_<old|new>_j<k>.{json,txt}; the summary goes to <prefix>_<bench>_<ranks>ranks_summary.txt.
"""
import argparse
import glob
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

BENCH_SCRIPTS = {"allreduce": "benchmarks/allreduce.py", "train": "benchmarks/train_scaling.py",
                 "step_breakdown": "benchmarks/step_breakdown.py"}
MPI_BENCHES = ("allreduce", "step_breakdown")          # launched with mpiexec -n --ranks
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git(*args, cwd=REPO):
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def load_average():
    return "%.2f %.2f %.2f" % os.getloadavg()


def abba(jobs):
    """The arm of each job: old, new, new, old, old, new, ... (each pair of pairs is balanced against drift)."""
    pattern = ["old", "new", "new", "old"]
    return [pattern[k % 4] for k in range(2 * jobs)]


def shown_command(cmd):
    """The command as a reader would type it: no interpreter or results paths of this machine in committed files."""
    shown = ["python" if part == sys.executable else part for part in cmd]
    return " ".join(os.path.relpath(part, REPO) if part.startswith(REPO + os.sep) else part for part in shown)


def run_job(checkout, bench, ranks, extra, json_path, text_path, timeout):
    script = BENCH_SCRIPTS[bench]
    if bench in MPI_BENCHES:
        cmd = ["mpiexec", "-n", str(ranks), sys.executable, script, "--json", json_path, *extra]
    else:
        cmd = [sys.executable, script, "--json", json_path, *extra]
    env = dict(os.environ, PYTHONPATH=checkout)
    header = "# commit %s, %s, load %s\n# %s\n" % (git("rev-parse", "HEAD", cwd=checkout),
                                                 time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                                                 load_average(), shown_command(cmd))
    proc = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True, timeout=timeout)
    with open(text_path, "w") as f:
        f.write(header + proc.stdout + proc.stderr[-4000:] + "# load at end %s\n" % load_average())
    if proc.returncode != 0:
        raise SystemExit("job failed (rc %d), see %s" % (proc.returncode, text_path))


def relative_to(rows, reference, position=0):
    """Each row divided by the same job's reference row (the key with `reference` at `position`), named row/reference.

    Load that slows a whole job slows its reference too, so these ratios hold still where the raw figures move. Used
    for training (against lockstep); MPI_Allreduce moves too much from job to job to be a reference for allreduce.
    """
    ratios = {}
    for key, value in rows.items():
        ref_key = key[:position] + (reference,) + key[position + 1:]
        if key[position] != reference and ref_key in rows:
            ratios[key[:position] + ("%s/%s" % (key[position], reference),) + key[position + 1:]] = value / rows[ref_key]
    return ratios


def allreduce_rows(records):
    """(impl, bytes) -> time_us, and the count of wrong results (must be 0)."""
    rows = {(r["impl"], r["bytes"]): r["time_us"] for r in records}
    return rows, sum(r.get("wrong", 0) for r in records)


def train_rows(document):
    """(model, mode, ranks) -> samples/s in total, and the count of runs whose parameters left sync (must be 0)."""
    records = [r for r in document["records"] if "samples_per_s_total" in r]   # peers not installed are skipped
    rows = {(r["model"], r["mode"], r["ranks"]): r["samples_per_s_total"] for r in records}
    rows.update(relative_to(rows, "lockstep", position=1))
    return rows, sum(not r["params_in_sync"] for r in records)


def step_rows(document):
    """(model, mode, figure) -> ms per step of the step account (step, fwd+bwd, after_last), and each mode's
    x lockstep (lockstep's step time over the mode's, in the same job)."""
    model, summary = document["model"], document["summary"]
    rows = {(model, mode, figure): s[figure] for mode, s in summary.items()
            for figure in ("step_wall", "fwd_bwd", "after_last") if s.get(figure) is not None}
    base = summary.get("lockstep")
    if base is not None:
        rows.update({(model, mode, "x lockstep"): base["step_wall"] / s["step_wall"]
                     for mode, s in summary.items() if mode != "lockstep"})
    return rows, 0


def summarize(bench, jobs_by_arm):
    """One table: per row each arm's median and best over its jobs, new/old of both, and each arm's spread.

    Load on a shared machine only ever adds time, so the best job of each arm is the steadier comparison of the code;
    the medians show what a user would see on the same machine. MPI_Allreduce (allreduce) and no-comm/lockstep
    (train) are the same code in both arms: their new/old is the noise floor of the run.
    """
    parse = {"allreduce": allreduce_rows, "train": train_rows, "step_breakdown": step_rows}[bench]
    # the better of two figures: times lower (allreduce, the step account's ms), rates and ratios higher
    better = {"allreduce": lambda key: min, "train": lambda key: max,
              "step_breakdown": lambda key: max if key[-1] == "x lockstep" else min}[bench]
    tables = {arm: [] for arm in jobs_by_arm}
    wrong = 0
    for arm, paths in jobs_by_arm.items():
        for path in paths:
            with open(path) as f:
                rows, bad = parse(json.load(f))
            tables[arm].append(rows)
            wrong += bad
    keys = sorted(set.intersection(*(set(rows) for arm in tables for rows in tables[arm])),
                  key=lambda k: tuple(str(x).zfill(12) for x in k))
    unit = {"allreduce": "time in us", "train": "samples/s in total",
            "step_breakdown": "ms per step, and x lockstep"}[bench]
    meaning = {"allreduce": "slower", "train": "faster",
               "step_breakdown": "slower in ms, faster in x lockstep"}[bench]
    lines = ["# %d old and %d new jobs, %s; new/old > 1 means the new commit is %s; spread = worst/best job of an arm"
             % (len(tables["old"]), len(tables["new"]), unit, meaning),
             "%-40s %10s %10s %8s %10s %10s %8s %7s %7s" % (
                 "row", "old med", "new med", "new/old", "old best", "new best", "new/old", "old spr", "new spr")]
    for key in keys:
        old = [rows[key] for rows in tables["old"]]
        new = [rows[key] for rows in tables["new"]]
        label = " ".join(str(x) for x in key)
        lines.append("%-40s %10.4g %10.4g %8.2f %10.4g %10.4g %8.2f %7.2f %7.2f" % (
            label, statistics.median(old), statistics.median(new), statistics.median(new) / statistics.median(old),
            better(key)(old), better(key)(new), better(key)(new) / better(key)(old), max(old) / min(old),
            max(new) / min(new)))
    lines.append("# wrong results or parameters out of sync, all jobs: %d" % wrong)
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="the commit before the change")
    parser.add_argument("--new", default="HEAD", help="the commit with the change")
    parser.add_argument("--bench", choices=sorted(BENCH_SCRIPTS), required=True)
    parser.add_argument("--ranks", type=int, default=2,
                        help="mpiexec ranks (allreduce, step_breakdown); a label only for train")
    parser.add_argument("--jobs", type=int, default=2, help="jobs per arm")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"))
    parser.add_argument("--prefix", default="commit_ab")
    parser.add_argument("--job-timeout", type=float, default=900.0)
    parser.add_argument("--summarize-only", action="store_true", help="re-read the jobs of an earlier run under --out")
    args, extra = parser.parse_known_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("terminated"))   # so the worktrees below are removed
    extra = [a for a in extra if a != "--"]
    args.out = os.path.abspath(args.out)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, "%s_%s_%dranks" % (args.prefix, args.bench, args.ranks))
    if args.summarize_only:
        jobs_by_arm = {arm: sorted(glob.glob("%s_%s_j*.json" % (stem, arm))) for arm in ("old", "new")}
        with open(stem + "_summary.txt") as f:
            header = f.readline()
        text = header + summarize(args.bench, jobs_by_arm) + "\n"
        with open(stem + "_summary.txt", "w") as f:
            f.write(text)
        print(text)
        return
    with tempfile.TemporaryDirectory(prefix="commit_ab_") as tmp:
        checkouts = {}
        for arm in ("old", "new"):
            checkouts[arm] = os.path.join(tmp, arm)
            git("worktree", "add", "--detach", checkouts[arm], getattr(args, arm))
        try:
            jobs_by_arm = {"old": [], "new": []}
            for k, arm in enumerate(abba(args.jobs)):
                json_path = "%s_%s_j%d.json" % (stem, arm, k)
                print("job %d/%d: %s (load %s)" % (k + 1, 2 * args.jobs, arm, load_average()), flush=True)
                run_job(checkouts[arm], args.bench, args.ranks, extra, json_path, json_path[:-5] + ".txt",
                        args.job_timeout)
                jobs_by_arm[arm].append(json_path)
            header = "# same-run A/B, %s, %d ranks: old = %s, new = %s, %d jobs per arm in ABBA order\n" % (
                args.bench, args.ranks, git("rev-parse", "--short", args.old), git("rev-parse", "--short", args.new),
                args.jobs)
            text = header + summarize(args.bench, jobs_by_arm) + "\n"
        finally:
            for path in checkouts.values():
                git("worktree", "remove", "--force", path)
    with open(stem + "_summary.txt", "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
