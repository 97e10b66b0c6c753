"""Runs tests/parallel/ as real mpiexec jobs on 2, 3 and 4 ranks (at 4, the files where the ring's size matters), so
`python -m pytest tests` covers them too.

Each job is `mpiexec -n N python -m mpi4py -m pytest --with-mpi -x ... tests/parallel` with a hard timeout.
`-m mpi4py` makes a rank that fails (pytest exits non-zero after -x) call MPI_Abort, which ends the whole job at once
instead of leaving the other ranks waiting in their next collective until the per-test timeout. On failure or timeout
the job's process group is killed and this test fails with the tail of the ranks' output.
Exit status 0 is not enough: each rank loads the pytest plugin tests/mpi_job_report.py, which ends it when MPI's world
is not the size launched and writes what it passed and skipped; the job fails unless every rank of that world passed
tests and skipped only for the reasons ALLOWED_SKIP_REASON names (GPU-only, more ranks, pretend nodes).

Single parallel file, by hand:  mpiexec -n 3 python -m pytest --with-mpi tests/parallel/test_collectives.py

Two more jobs run a focused set of files with RINGTRAIN_SIMULATE_NODES=2 (4 ranks as 2+2, 3 ranks as 2+1), so the
public API is checked on pretend nodes: hierarchical allreduce, and the flat ring across the split.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from ringtrain.launch import run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARALLEL_DIR = os.path.join(REPO, "tests", "parallel")
JOB_TIMEOUT_S = int(os.environ.get("RINGTRAIN_TEST_JOB_TIMEOUT_S", "900"))
PER_TEST_TIMEOUT_S = 120
OUTPUT_TAIL_CHARS = 30000
TESTS_DIR = os.path.join(REPO, "tests")
# The only skips a job may report, each a case that cannot exist in that job by design: tests that need a GPU (this
# machine and CI have none), cases that need more ranks than the job has (the 3- and 4-rank jobs run them), the
# pretend-node file outside the job that sets RINGTRAIN_SIMULATE_NODES, the one-node agreement path when ranks span
# nodes, dtype x op combinations whose reference would overflow, and the steady-state memory soak (its own 2-rank
# job covers one node and pretend nodes). Any other skip means a test did not run where
# it should have (an import guard, a world of 1): the job fails, though pytest exits 0. A new by-design skip gets
# its reason added here.
ALLOWED_SKIP_REASON = re.compile("|".join([
    r"CUDA|GPU|cupy",
    r"need at least \d+ ranks",
    r"needs RINGTRAIN_SIMULATE_NODES",
    r"ranks span nodes",
    r"overflow",
    r"steady-state memory soak runs in the 2-rank job",
]), re.IGNORECASE)

# Test-run settings for the ranks; anything already set in the environment wins.
RANK_ENVIRONMENT = {
    "OMP_NUM_THREADS": "1",                  # up to 4 ranks share CI's 2 cores
    "RINGTRAIN_STALL_WARNING_S": "10",
    "RINGTRAIN_STALL_TIMEOUT_S": "60",       # a stalled collective fails its test well before the per-test timeout
    "PYTHONFAULTHANDLER": "1",               # a rank stuck at the per-test timeout dumps its threads' stacks
}


def job_command(num_ranks, mpiexec, flavor, directory=PARALLEL_DIR):
    cmd = [mpiexec, "-n", str(num_ranks)]
    if flavor == "hydra":
        cmd.append("-prepend-rank")          # "[r] ..." on every line: whose output is whose
    return cmd + [sys.executable, "-m", "mpi4py", "-m", "pytest", "--with-mpi", "-x", "-q", "-p", "no:cacheprovider",
                  "-p", "mpi_job_report", f"--timeout={PER_TEST_TIMEOUT_S}",
                  *([directory] if isinstance(directory, str) else directory)]


def job_environment(num_ranks, report_dir):
    env = dict(os.environ)
    for name, value in RANK_ENVIRONMENT.items():
        env.setdefault(name, value)
    env["RINGTRAIN_TEST_WORLD_SIZE"] = str(num_ranks)   # read by tests/mpi_job_report.py in every rank
    env["RINGTRAIN_TEST_REPORT_DIR"] = report_dir
    # the ranks import the ringtrain under test, installed or not (and the report plugin from tests/)
    env["PYTHONPATH"] = os.pathsep.join([REPO, TESTS_DIR] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def read_rank_reports(directory):
    reports = []
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name)) as f:
            reports.append(json.load(f))
    return reports


def check_job_report(reports, num_ranks):
    """From the ranks' own reports: '' when every rank of the expected world passed tests and skipped only for the
    reasons ALLOWED_SKIP_REASON names, else why not. A job whose ranks all skip (a world of 1 sees only mpi(min_size=2) skips) exits 0: this is
    what catches it."""
    ranks = sorted(r["rank"] for r in reports)
    if ranks != list(range(num_ranks)) or any(r["world_size"] != num_ranks for r in reports):
        return (f"expected a report from each rank of a world of {num_ranks}, got ranks {ranks} of worlds "
                f"{sorted({r['world_size'] for r in reports})}")
    idle = [r["rank"] for r in reports if r["passed"] == 0]
    if idle:
        return f"ranks {idle} passed no tests"
    other = sorted({reason for r in reports for reason in r["skipped"] if not ALLOWED_SKIP_REASON.search(reason)})
    if other:
        return f"skips for reasons not allowed in a job (see ALLOWED_SKIP_REASON): {other[:10]}"
    return ""


def tail(path):
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - OUTPUT_TAIL_CHARS))
        return f.read().decode(errors="replace")


# Every file runs at 2 ranks. The 3-rank job runs the files whose outcome depends on the ring's size: the ring
# schedule and its chunking (uneven at 3), fusion, sharding and resharding, process sets, hierarchy, Adasum, the
# agreement and the native cycle with more than one peer (express, grouped, join, consistency, recovery, soak,
# straggler scores, a rank that never arrives), every call form, and the torch rules whose splits are uneven at 3
# (reducescatter, autograd). The other API wrappers (torch functions and optimizers, naming, checkpoints, shared
# arrays) behave alike at any size and run at 2 ranks only: CI has 2 cores.
SIZE_MATTERS_FILES = ["test_adasum.py", "test_api_forms.py", "test_collectives.py", "test_consistency.py",
                      "test_engine_steady_state.py", "test_express.py", "test_flag_barrier.py",
                      "test_fused_allreduce.py", "test_grouped_express.py", "test_hierarchical.py", "test_join.py",
                      "test_native_cycle.py", "test_observability.py", "test_process_sets.py", "test_recovery.py",
                      "test_reducer_ranks.py", "test_sharded_optimizer.py", "test_soak.py", "test_sync_batch_norm.py",
                      "test_torch_autograd.py", "test_torch_horovod_rules.py", "test_transports.py",
                      "test_window_results.py"]
# The 4-rank job (4 ranks on 2 cores: the slowest per test) adds what a fourth rank changes: a power of two
# (Adasum's halving), two pairs (process sets of evens and odds, 2+2 hierarchy), resharding 4 -> 1, 2, 3, the
# collectives and every call form once more, joins, consistency, synchronized batch norm and steady-state memory.
FOUR_RANK_FILES = ["test_adasum.py", "test_api_forms.py", "test_collectives.py", "test_consistency.py",
                   "test_engine_steady_state.py", "test_hierarchical.py", "test_join.py", "test_process_sets.py",
                   "test_reducer_ranks.py", "test_sharded_optimizer.py", "test_sync_batch_norm.py"]


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("num_ranks", [2, 3, 4])
def test_parallel_suite(num_ranks):
    names = {3: SIZE_MATTERS_FILES, 4: FOUR_RANK_FILES}.get(num_ranks)
    run_job(num_ranks, PARALLEL_DIR if names is None else [os.path.join(PARALLEL_DIR, name) for name in names],
            JOB_TIMEOUT_S)


def test_the_size_matters_files_exist():
    assert [f for f in SIZE_MATTERS_FILES if not os.path.isfile(os.path.join(PARALLEL_DIR, f))] == []
    assert set(FOUR_RANK_FILES) <= set(SIZE_MATTERS_FILES)


# on pretend nodes the sharded optimizer's collectives take the hierarchical transport: its equivalence with one
# process runs there (saving and loading shards does not depend on the nodes)
SIMULATED_NODES_FILES = ["test_simulated_nodes.py", "test_collectives.py", "test_engine_steady_state.py",
                         "test_sharded_optimizer.py::test_n_ranks_equal_one_process"]


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("num_ranks", [4, 3])
def test_parallel_suite_on_two_simulated_nodes(num_ranks):
    # 2+2 runs every file above; 2+1 (nodes of unequal size) the ones where the split itself matters
    names = SIMULATED_NODES_FILES if num_ranks == 4 else SIMULATED_NODES_FILES[:2]
    run_job(num_ranks, [os.path.join(PARALLEL_DIR, name) for name in names], JOB_TIMEOUT_S,
            extra_env={"RINGTRAIN_SIMULATE_NODES": "2"})


def run_job(num_ranks, directory, timeout_s, extra_env=None):
    """One mpiexec job of `pytest --with-mpi directory`; fails the calling test with the ranks' output tail."""
    mpiexec = run.find_mpiexec()
    cmd = job_command(num_ranks, mpiexec, run.mpi_flavor(mpiexec), directory)
    report_dir = tempfile.mkdtemp(prefix=f"ringtrain-parallel-{num_ranks}-reports-")
    env = job_environment(num_ranks, report_dir)
    env.update(extra_env or {})
    with tempfile.NamedTemporaryFile(prefix=f"ringtrain-parallel-{num_ranks}-", suffix=".log", delete=False) as log:
        log_path = log.name
    start = time.monotonic()
    try:
        with open(log_path, "wb") as log:
            # own session: on timeout we SIGKILL mpiexec's group, and hydra's proxy then kills every rank
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                returncode = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                returncode = None
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        elapsed = time.monotonic() - start
        output = tail(log_path)
        if returncode is None:
            pytest.fail(f"{num_ranks}-rank job did not finish within {timeout_s} s and was killed.\n"
                        f"command: {' '.join(cmd)}\n--- last ranks' output ---\n{output}", pytrace=False)
        if returncode != 0:
            pytest.fail(f"{num_ranks}-rank job failed (mpiexec exit status {returncode}, {elapsed:.0f} s).\n"
                        f"command: {' '.join(cmd)}\n--- last ranks' output ---\n{output}", pytrace=False)
        problem = check_job_report(read_rank_reports(report_dir), num_ranks)
        if problem:
            pytest.fail(f"{num_ranks}-rank job exited 0 but did not really run: {problem}\n"
                        f"command: {' '.join(cmd)}\n--- last ranks' output ---\n{output}", pytrace=False)
        print(f"{num_ranks}-rank job passed in {elapsed:.1f} s:\n{output[-2000:]}")
    finally:
        os.unlink(log_path)
        shutil.rmtree(report_dir, ignore_errors=True)


def report(rank, world=2, passed=9, skipped=("Skipped: no CUDA device",)):
    return {"rank": rank, "world_size": world, "exitstatus": 0, "passed": passed, "failed": 0,
            "skipped": list(skipped)}


def test_job_report_accepts_passes_with_gpu_and_rank_count_skips_only():
    assert check_job_report([report(0), report(1)], 2) == ""
    fewer_ranks = ["Skipped: no CUDA device", "Skipped: 3 pretend nodes need at least 3 ranks"]
    assert check_job_report([report(0, skipped=fewer_ranks), report(1, skipped=fewer_ranks)], 2) == ""


def test_job_report_rejects_a_wrong_world_idle_ranks_and_other_skips():
    singletons = [report(0, world=1), report(0, world=1)]
    assert "from each rank of a world of 2" in check_job_report(singletons, 2)
    assert "from each rank of a world of 3" in check_job_report([report(0, 3), report(1, 3)], 3)
    all_skipped = [report(r, passed=0, skipped=["Skipped: Need at least 2 MPI processes"]) for r in range(2)]
    assert "ranks [0, 1] passed no tests" in check_job_report(all_skipped, 2)
    torchless = [report(r, 3, skipped=["Skipped: no CUDA device", "Skipped: could not import 'torch'"])
                 for r in range(3)]
    assert "could not import 'torch'" in check_job_report(torchless, 3)
