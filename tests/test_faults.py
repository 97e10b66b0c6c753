"""Fault matrix: real mpiexec jobs (tests/fault_scripts/) that go wrong on purpose.

Every case asserts the job ends well within 30 s, with the exit code it must have, and with the culprit named in
each rank's own output line ("rank r: CAUGHT[case] ErrorType: message"). Cases that leave the job usable
(mismatches, bad input) must exit 0 after a correct allreduce on every rank.
"""
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "fault_scripts"
MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
MUST_END_S = 30.0
HARD_KILL_S = 60.0   # our own safety net: past this the whole process group is killed and the test fails

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found")
# the cheapest cases run again on 3 ranks as two pretend nodes (2+1): hierarchical allreduce, mpi across the split
SPLIT = {"RINGTRAIN_SIMULATE_NODES": "2"}


def _nodes_id(value):
    return ("two-nodes" if value else "one-node") if isinstance(value, dict) else None


def _env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env.update(RINGTRAIN_STALL_WARNING_S="1", RINGTRAIN_STALL_TIMEOUT_S="3", RINGTRAIN_PEER_CHECK_S="0.2",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


class Job:
    """A finished (or killed) job: exit code, wall time, combined output, and the lines each rank printed."""

    def __init__(self, returncode, seconds, output):
        self.returncode, self.seconds, self.output = returncode, seconds, output

    def lines_of(self, rank):
        return [line for line in self.output.splitlines() if line.startswith(f"rank {rank}:")]

    def caught(self, rank):
        """The error line rank printed, or None."""
        return next((line for line in self.lines_of(rank) if "CAUGHT[" in line), None)

    def pids(self):
        return [int(p) for p in re.findall(r"^rank \d+: PID (\d+)$", self.output, re.M)]

    def __str__(self):
        return f"exit {self.returncode} after {self.seconds:.1f}s; output:\n{self.output}"

    __repr__ = __str__


def _kill_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_job(script, n, *args, launcher_args=(), **env):
    cmd = [MPIEXEC, *launcher_args, "-n", str(n), sys.executable, str(SCRIPTS / script), *args]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(**env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=HARD_KILL_S)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, _ = proc.communicate()
        pytest.fail(f"{script} {args} with {n} ranks still running after {HARD_KILL_S}s:\n{out}")
    job = Job(proc.returncode, time.monotonic() - start, out)
    print(f"\n[fault] {script} {' '.join(args)} n={n}: exit {job.returncode} in {job.seconds:.1f}s")
    for rank in range(n):
        print(f"[fault]   {job.caught(rank) or (job.lines_of(rank) or ['(no line)'])[-1]}")
    return job


def _assert_no_leftovers(pids):
    from ringtrain.watchdog import _alive
    deadline = time.monotonic() + 3.0
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if _alive(p)], f"processes left behind: {[p for p in pids if _alive(p)]}"


# ---- errors that leave the job usable ----

@pytest.mark.parametrize("case,n,env", [("shape", 3, {}), ("dtype", 3, {}), ("op", 3, {}), ("root", 3, {}),
                                        ("kind", 3, {}), ("shape", 2, {}), ("shape", 3, SPLIT)], ids=_nodes_id)
def test_divergent_tensor_is_named_on_every_rank_and_job_stays_usable(case, n, env):
    job = run_job("mismatch.py", n, case, **env)
    assert job.returncode == 0, job
    assert job.seconds < MUST_END_S, job
    odd = n - 1
    for rank in range(n):
        line = job.caught(rank)
        assert line and "TensorMismatchError" in line and "grad.w" in line, job
        assert f"rank {odd}" in line.split("CAUGHT", 1)[1], job          # the divergent rank is named ...
        assert re.search(r"ranks? 0\b", line.split("CAUGHT", 1)[1]), job   # ... next to what the others had
        assert f"rank {rank}: USABLE" in job.output, job
    detail = {"shape": ("(4, 4)", "(4, 3)"), "dtype": ("float32", "float64"), "op": ("sum", "max"),
              "root": ("0", "1"), "kind": ("allreduce", "allgather")}[case]
    message = job.caught(0).lower()
    assert all(value in message for value in detail), job


def test_divergent_name_stalls_then_errors_everywhere():
    job = run_job("divergent_name.py", 2)
    assert job.returncode != 0, job               # a stall is fatal to the engine
    assert job.seconds < MUST_END_S, job
    for rank in range(2):
        line = job.caught(rank)
        assert line and "StallError" in line, job
        assert re.search(r"'grad\.a'.*rank 0\b.*rank 1\b", line), job     # who has it, who is missing
        assert re.search(r"'grad\.b'.*rank 1\b.*rank 0\b", line), job
        assert f"rank {rank}: AFTER-STALL StallError" in job.output, job   # later calls fail fast, no hang


def test_bad_input_is_a_clear_error_and_job_stays_usable():
    job = run_job("bad_input.py", 2)
    assert job.returncode == 0, job
    for rank in range(2):
        assert f"rank {rank}: EXPECTED 6" in job.output, job
        for case in ("before_init", "non_contiguous", "complex64", "root_too_big", "bool_sum", "after_shutdown"):
            assert f"CAUGHT[{case}]" in "\n".join(job.lines_of(rank)), (case, str(job))
    text = job.output
    assert re.search(r"CAUGHT\[complex64\].*complex64", text), job
    assert re.search(r"CAUGHT\[root_too_big\].*\b2\b", text), job          # names the bad root (== size)
    assert re.search(r"CAUGHT\[non_contiguous\].*contiguous", text, re.I), job


# ---- errors that end the job ----

@pytest.mark.parametrize("n,env", [(2, {}), (3, {}), (3, SPLIT)], ids=_nodes_id)
def test_skipped_step_warns_then_stall_error_on_every_rank(n, env):
    job = run_job("skip_step.py", n, **env)
    assert job.returncode != 0, job
    assert job.seconds < MUST_END_S, job
    skipper = n - 1
    for rank in range(n):
        line = job.caught(rank)
        assert line and "StallError" in line, job
    for rank in range(n - 1):   # the ranks left waiting for step 2 are told who is missing
        assert re.search(rf"grad\.step2.*\b{skipper}\b", job.caught(rank)), job
    assert re.search(rf"(?i)warn.*grad\.step2.*\b{skipper}\b", job.output), job   # the early warning


def test_exception_in_training_loop_ends_job_and_names_rank():
    job = run_job("raise_in_loop.py", 3)
    assert job.returncode != 0, job
    assert job.seconds < MUST_END_S, job
    assert "user code failed on rank 1 at step 3" in job.output, job
    # the survivors either report the failed peer themselves or the launcher names it
    named = [job.caught(r) for r in (0, 2) if job.caught(r) and re.search(r"rank 1\b", job.caught(r).split("CAUGHT")[1])]
    assert named or re.search(r"(?s)BAD TERMINATION.*RANK 1\b", job.output), job
    _assert_no_leftovers(job.pids())


@pytest.mark.parametrize("n,env", [(2, {}), (3, {}), (3, SPLIT)], ids=_nodes_id)
def test_sigkill_mid_allreduce_ends_everything(n, env):
    """Hydra (MPICH's mpiexec) SIGKILLs the survivors itself within about a second of one rank dying, usually
    before ringtrain's watchdog (RINGTRAIN_PEER_CHECK_S) can print its own "rank r (pid p) has died" line;
    this happens even with -disable-auto-cleanup. So the culprit is named either by ringtrain's line or by
    hydra's BAD TERMINATION report, which names a PID of the job (the first one hydra reaped)."""
    job = run_job("sigkill.py", n, **env)
    assert job.returncode != 0, job
    assert job.seconds < MUST_END_S, job
    pids = dict(re.findall(r"^rank (\d+): PID (\d+)$", job.output, re.M))
    assert len(pids) == n, job
    victim = n - 1
    ours = re.search(rf"rank {victim} \(pid {pids[str(victim)]}\) has died", job.output)
    hydra = re.search(r"BAD TERMINATION.*?PID (\d+)", job.output, re.S)
    assert ours or (hydra and hydra.group(1) in pids.values()), job
    _assert_no_leftovers([int(p) for p in pids.values()])


def test_rank_calling_shutdown_early_is_named_on_the_others():
    n = 3
    job = run_job("early_shutdown.py", n)
    assert job.returncode != 0, job
    assert job.seconds < MUST_END_S, job
    quitter = n - 1
    for rank in range(n - 1):
        line = job.caught(rank)
        assert line and re.search(r"RankFailureError|ShutdownError", line), job
        assert re.search(rf"rank {quitter}\b", line.split("CAUGHT")[1]), job
    # it must be the shutdown that was noticed, not a stall timeout
    assert job.seconds < 3.0 + 10.0, job


# ---- the launcher ----

def _launcher_cmd():
    try:
        import ringtrain.run  # noqa: F401
    except ImportError:
        return None
    return [sys.executable, "-m", "ringtrain.run", "-np", "2", sys.executable, str(SCRIPTS / "long_loop.py")]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_launcher_stops_every_rank(sig):
    cmd = _launcher_cmd()
    if cmd is None:
        pytest.skip("ringtrain.run (the ringtrain-run launcher) is not there yet")
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 30
        while sum("RUNNING" in line for line in lines) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.05)
        pids = [int(p) for p in re.findall(r"^rank \d+: PID (\d+)$", "".join(lines), re.M)]
        start = time.monotonic()
        proc.send_signal(sig)           # to the launcher only: forwarding to the ranks is its job
        code = proc.wait(timeout=MUST_END_S)
        seconds = time.monotonic() - start
    finally:
        _kill_group(proc)
    reader.join(5)
    output = "".join(lines)
    print(f"\n[fault] ringtrain-run {sig.name}: exit {code} in {seconds:.1f}s; "
          + " | ".join(line.strip() for line in lines if line.startswith("ringtrain-run")))
    assert code != 0, output
    assert seconds < MUST_END_S
    assert f"job stopped by {sig.name}" in output, output
    _assert_no_leftovers(pids)


def test_sigkill_under_launcher_names_the_dead_rank():
    """ringtrain-run wraps each rank, so it can say which rank died even though hydra only reports pids."""
    if _launcher_cmd() is None:
        pytest.skip("ringtrain.run (the ringtrain-run launcher) is not there yet")
    n = 3
    cmd = [sys.executable, "-m", "ringtrain.run", "-np", str(n), sys.executable, str(SCRIPTS / "sigkill.py")]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=HARD_KILL_S, start_new_session=True)
    job = Job(proc.returncode, time.monotonic() - start, proc.stdout)
    print(f"\n[fault] ringtrain-run sigkill.py n={n}: exit {job.returncode} in {job.seconds:.1f}s; "
          + " | ".join(line for line in job.output.splitlines() if line.startswith("ringtrain-run")))
    assert job.returncode != 0, job
    assert job.seconds < MUST_END_S, job
    assert re.search(rf"ringtrain-run: rank {n - 1} .*killed by signal SIGKILL", job.output), job
    _assert_no_leftovers(job.pids())
