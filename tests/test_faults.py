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
import tempfile
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
    """A finished (or killed) job: exit code, wall time, output, and the lines each rank printed.

    The ranks' own lines (fault_scripts/_common.say: stdout, one write per line) are read apart from their stderr
    (tracebacks, ringtrain's log lines): the launcher forwards each stream as it comes, so in one merged pipe a line of
    one rank can land behind a line another rank is still writing to the other stream (seen under load: rank 0's
    CAUGHT line behind part of rank 2's traceback). `output` is both: stdout, then stderr."""

    def __init__(self, returncode, seconds, stdout, stderr=""):
        self.returncode, self.seconds, self.stdout, self.stderr = returncode, seconds, stdout, stderr
        self.output = stdout + ("\n" if stdout and not stdout.endswith("\n") else "") + stderr

    def lines_of(self, rank):
        return [line for line in self.stdout.splitlines() if line.startswith(f"rank {rank}:")]

    def caught(self, rank):
        """The error line rank printed, or None."""
        return next((line for line in self.lines_of(rank) if "CAUGHT[" in line), None)

    def pids(self):
        return [int(p) for p in re.findall(r"^rank \d+: PID (\d+)$", self.stdout, re.M)]

    def __str__(self):
        if not self.stderr:
            return f"exit {self.returncode} after {self.seconds:.1f}s; output:\n{self.stdout}"
        return (f"exit {self.returncode} after {self.seconds:.1f}s; stdout:\n{self.stdout}\n"
                f"stderr:\n{self.stderr}")

    __repr__ = __str__


def _kill_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# Hydra SIGKILLs every rank within about a second of one dying by a signal (even with -disable-auto-cleanup), and as
# soon as one exits non-zero: often before the other ranks could say what they caught (seen on CI: rank 1 of the
# unresolved-cycle job killed before its CAUGHT line; under load, the second survivor of a SIGKILL). Under this shell
# a rank that ends non-zero, by a signal or not, keeps hydra from knowing until every rank the test expects to speak
# has (each leaves a file in $RINGTRAIN_TEST_SPOKE once it printed its lines: fault_scripts/_common.done_speaking),
# or SPEAK_WAIT_S passed: which rank ends first no longer decides which ranks get to speak, at any load, and no job
# waits longer than its ranks take to speak.
SPEAK_WAIT_S = 15
WAIT_FOR_SPEAKERS = ('python "$0" "$@"; s=$?; if [ $s -ne 0 ]; then i=0; '
                     'while [ "$(ls "$RINGTRAIN_TEST_SPOKE" | wc -l)" -lt "$RINGTRAIN_TEST_SPEAKERS" ] '
                     f'&& [ $i -lt {SPEAK_WAIT_S * 10} ]; do sleep 0.1; i=$((i + 1)); done; fi; exit $s')


def run_job(script, n, *args, launcher_args=(), speakers=0, ringtrain_run=False, hard_kill_s=HARD_KILL_S, **env):
    """speakers: run the ranks under WAIT_FOR_SPEAKERS, until that many ranks called done_speaking().
    ringtrain_run: launch with ringtrain-run instead of mpiexec (whose wrapper of each rank then waits for the shell;
    the shell runs the script with `python -m mpi4py`, as ringtrain-run runs a Python script)."""
    rank_cmd = [sys.executable, str(SCRIPTS / script), *args]
    spoke = None
    if speakers:
        spoke = tempfile.mkdtemp(prefix="ringtrain-spoke-")
        env = dict(env, RINGTRAIN_TEST_SPOKE=spoke, RINGTRAIN_TEST_SPEAKERS=speakers)
        python = f"{sys.executable} -m mpi4py" if ringtrain_run else sys.executable
        rank_cmd = ["sh", "-c", WAIT_FOR_SPEAKERS.replace("python", python, 1), *rank_cmd[1:]]
    if ringtrain_run:
        cmd = [sys.executable, "-m", "ringtrain.launch.run", *launcher_args, "-np", str(n), *rank_cmd]
    else:
        cmd = [MPIEXEC, *launcher_args, "-n", str(n), *rank_cmd]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=hard_kill_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, err = proc.communicate()
        pytest.fail(f"{script} {args} with {n} ranks still running after {hard_kill_s}s:\n{out}\nstderr:\n{err}")
    finally:
        if spoke:
            shutil.rmtree(spoke, ignore_errors=True)
    job = Job(proc.returncode, time.monotonic() - start, out, err)
    print(f"\n[fault] {script} {' '.join(args)} n={n}: exit {job.returncode} in {job.seconds:.1f}s")
    for rank in range(n):
        print(f"[fault]   {job.caught(rank) or (job.lines_of(rank) or ['(no line)'])[-1]}")
    return job


def _assert_no_leftovers(pids):
    from ringtrain.engine.watchdog import _alive
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
    # what the others had, and what the odd rank had, each next to its ranks
    others = "rank 0 has" if n == 2 else f"ranks {','.join(map(str, range(n - 1)))} have"
    detail = {"shape": ("allreduce shape (4, 4) float32 op Sum", "allreduce shape (4, 3) float32 op Sum"),
              "dtype": ("allreduce shape (4, 4) float32 op Sum", "allreduce shape (4, 4) float64 op Sum"),
              "op": ("allreduce shape (4, 4) float32 op Sum", "allreduce shape (4, 4) float32 op Max"),
              "root": ("broadcast shape (4, 4) float32 root 0", "broadcast shape (4, 4) float32 root 1"),
              "kind": ("allreduce shape (4, 4) float32 op Average", "allgather shape (*, 4) float32")}[case]
    for rank in range(n):
        message = job.caught(rank)
        assert f"{others} {detail[0]}" in message and f"rank {odd} has {detail[1]}" in message, job


# each binding at 2 ranks; the naming of several ranks that waited is checked at 3 by the skipped-step and the
# divergent-tensor tests
@pytest.mark.parametrize("n,framework", [(2, "numpy"), (2, "torch"), (2, "tensorflow")])
def test_a_stall_leaves_the_job_usable(n, framework):
    """One rank skips an allreduce, then every rank runs ten more; then one rank names an allreduce differently,
    and ten more. Every rank learns of each stall with the tensor and the ranks named, and the calls after it are
    correct: the stalled collectives are dropped everywhere, nothing is left over to poison later calls."""
    # a 1 s stall timeout (the others' 3 s): this job waits out three stalls per framework, one after the other.
    # What keeps the calls after a stall from stalling in turn follows the timeout (the skipping rank waits for the
    # stall warning of the call it skips; the two sides of the divergence end one timeout apart), so a short one
    # tests the same. The warning at 0.25 s: the skipping rank's next call, submitted on that warning (at 0.25-0.75 s),
    # has waited past it too when the stall comes (at the first 0.5 s stall check past 1 s), so the stall sees both
    # and must end only the skipped one
    job = run_job("stall_then_continue.py", n, framework, RINGTRAIN_STALL_TIMEOUT_S=1, RINGTRAIN_STALL_WARNING_S=0.25)
    assert job.returncode == 0, job
    odd = n - 1
    for rank in range(n):
        lines = "\n".join(job.lines_of(rank))
        assert "TEN CORRECT skip" in lines and "TEN CORRECT diverge" in lines and "DONE" in lines, job
        assert re.search(r"CAUGHT\[diverge\] StallError: .*'diverge\.(stalled|other)' was submitted by", lines), job
    others = "rank 0" if n == 2 else "ranks 0,1"
    for rank in range(n - 1):
        line = job.caught(rank)
        assert re.search(rf"CAUGHT\[skip\] StallError: .*'skip\.stalled' was submitted by {others} but not by "
                         rf"rank {odd}\b", line), job
    # the rank that skipped has no failed call of its own: its log says what stalled, and where
    assert re.search(rf"rank {odd}: LOGGED .*'skip\.stalled' was submitted by {others} but not by rank {odd}\b",
                     job.output), job
    assert job.caught(odd) is None or "skip" not in job.caught(odd), job


def test_divergent_name_stalls_then_errors_everywhere():
    # two stalls, one after the other. grad.b is submitted once rank 1 is warned that grad.a waits (0.25 s, then up
    # to a stall check period of 0.5 s): when grad.a's stall comes (2 to 2.5 s), grad.b has waited past the warning
    # threshold, so rank 0's message names it too, unless rank 1's submission took over a second to arrive
    job = run_job("divergent_name.py", 2, RINGTRAIN_STALL_TIMEOUT_S=2, RINGTRAIN_STALL_WARNING_S=0.25)
    assert job.returncode == 0, job               # a stall ends the collectives in it, not the job
    assert job.seconds < MUST_END_S, job
    for rank in range(2):
        line = job.caught(rank)
        assert line and "StallError" in line, job
        assert re.search(r"'grad\.b'.*rank 1\b.*rank 0\b", line), job     # who has it, who is missing
        assert f"rank {rank}: USABLE" in job.output, job                    # later calls work
    # rank 0's grad.a, the older side, ends first, and its message shows both sides
    assert re.search(r"'grad\.a'.*rank 0\b.*rank 1\b", job.caught(0)), job


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

@pytest.mark.parametrize("n,env", [(2, {}), (3, SPLIT)], ids=_nodes_id)
def test_skipped_step_warns_then_stall_error_and_the_loop_goes_on(n, env):
    job = run_job("skip_step.py", n, RINGTRAIN_STALL_TIMEOUT_S=2, **env)    # the warning at 1 s, the error at 2
    assert job.returncode == 0, job
    assert job.seconds < MUST_END_S, job
    skipper = n - 1
    for rank in range(n - 1):   # the ranks left waiting for step 2 are told who is missing
        line = job.caught(rank)
        assert line and "StallError" in line, job
        assert re.search(rf"grad\.step2.*\b{skipper}\b", line), job
    assert job.caught(skipper) is None, job      # its step 3 was the others' next call: nothing of its failed
    for rank in range(n):       # the early warning, logged on every rank before the StallError, names the skipper
        # (alone, or with a rank whose own submission of step 2 came over a second after the first one's)
        assert re.search(rf"^\[ringtrain WARNING\] rank {rank}: tensor 'grad\.step2' has waited \d+s: submitted by "
                         rf"ranks? [0-9,]+, still missing on ranks? (?:\d+,)*{skipper} ", job.output, re.M), job
    for rank in range(n):
        assert f"rank {rank}: STEPS DONE" in job.output, job


def test_a_cycle_its_caller_never_finishes_ends_in_a_stall_error_naming_it():
    """The compiled express call published a cycle and its caller never came back to finish it: the engine fails
    with a StallError naming the allreduce after the stall timeout (no pass runs over that cycle meanwhile), the
    peers learn of it, and the job ends -- never a hang."""
    job = run_job("unresolved_cycle.py", 2, speakers=2, RINGTRAIN_STALL_TIMEOUT_S="2")
    if "NO COMPILED CALL" in job.output:
        pytest.skip("no compiled express call here")
    assert job.returncode != 0 and job.seconds < MUST_END_S, job
    assert "rank 0: OUTCOME 0" in job.output, job
    for rank in range(2):
        line = job.caught(rank)
        assert line and "'gap.call'" in line and "has not finished that cycle" in line, job
    _assert_no_leftovers(job.pids())


def test_exception_in_training_loop_ends_job_and_names_rank():
    job = run_job("raise_in_loop.py", 3, speakers=2)
    assert job.returncode != 0, job
    assert job.seconds < MUST_END_S, job
    # not the script's own exception text: ringtrain's error on both survivors names the rank that left (no exit
    # ends the job before both spoke: WAIT_FOR_SPEAKERS)
    for rank in (0, 2):
        line = job.caught(rank)
        assert line and re.search(r"RankFailureError|ShutdownError", line), job
        # rank 1 named, alone or in the list of ranks gone ("ranks 1,2 already called shutdown()": rank 2 may have
        # caught its own error and left before rank 0's engine learnt of rank 1)
        assert re.search(r"\branks? (?:\d+,)*1\b", line.split("CAUGHT", 1)[1]), job
    _assert_no_leftovers(job.pids())


@pytest.mark.parametrize("n,env", [(2, {}), (3, SPLIT)], ids=_nodes_id)
def test_sigkill_mid_allreduce_ends_everything(n, env):
    """The survivors' watchdogs notice the dead process and end their ranks, each naming it in ringtrain's own
    line. The ranks run under WAIT_FOR_SPEAKERS, so hydra's clean-up cannot do it for them. Under the split
    (2+1) the victim is alone on the other pretend node: the watchdog watches every pid of the machine."""
    job = run_job("sigkill.py", n, speakers=n - 1, **env)
    assert job.returncode != 0, job
    assert job.seconds < MUST_END_S, job
    pids = dict(re.findall(r"^rank (\d+): PID (\d+)$", job.output, re.M))
    assert len(pids) == n, job
    victim = n - 1
    # each survivor ends on its own watchdog's word, naming a dead rank by rank and pid: the victim, or (3 ranks) the
    # other survivor if that one already ended -- but the victim is named by at least one of them
    named = {}
    for rank in range(n - 1):
        # not anchored at a line start: the ranks share one stderr pipe, and another rank's traceback line may be
        # mid-write when this one lands (seen under load: "    ringtrain rank 0: ..." after a traceback's indent)
        found = re.search(rf"ringtrain rank {rank}: rank (\d+) \(pid (\d+)\) has died", job.output)
        assert found, f"rank {rank} did not name a dead rank itself:\n{job}"
        assert pids[found.group(1)] == found.group(2) and found.group(1) != str(rank), job
        named[rank] = int(found.group(1))
    assert victim in named.values(), job
    _assert_no_leftovers([int(p) for p in pids.values()])


def test_rank_calling_shutdown_early_is_named_on_the_others():
    """The others must notice the shutdown message itself: not the quitter's death (it stays alive until they
    have all caught their error, or 6 s after its shutdown(), longer than the 5 s allowed here) and not a stall
    (its timeout, 10 s, is past that too)."""
    n = 3
    job = run_job("early_shutdown.py", n, speakers=n - 1, hard_kill_s=MUST_END_S, RINGTRAIN_STALL_TIMEOUT_S=10)
    assert job.returncode != 0, job
    assert job.seconds < MUST_END_S, job
    quitter = n - 1
    shut_at = float(re.search(rf"rank {quitter}: SHUTTING DOWN EARLY at (\d+\.\d+)", job.output).group(1))
    for rank in range(n - 1):
        line = job.caught(rank)
        assert line and re.search(r"RankFailureError|ShutdownError", line), job
        assert re.search(rf"rank {quitter} already called shutdown\(\)", line.split("CAUGHT")[1]), job
        caught_at = float(re.search(rf"rank {rank}: CAUGHT-AT (\d+\.\d+)", job.output).group(1))
        assert caught_at - shut_at < 5.0, f"rank {rank} took {caught_at - shut_at:.1f} s to notice:\n{job}"


# ---- the launcher ----

def _launcher_cmd():
    return [sys.executable, "-m", "ringtrain.launch.run", "-np", "2", sys.executable, str(SCRIPTS / "long_loop.py")]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_launcher_stops_every_rank(sig):
    cmd = _launcher_cmd()
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
    n = 3
    cmd = [sys.executable, "-m", "ringtrain.launch.run", "-np", str(n), sys.executable, str(SCRIPTS / "sigkill.py")]
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


@pytest.mark.parametrize("where,n,launcher", [("executor", 3, False), ("agreement", 3, False), ("executor", 2, True)],
                         ids=["executor-mpiexec", "agreement-mpiexec", "executor-ringtrain-run"])
def test_crash_in_one_engine_ends_every_rank_naming_it(where, n, launcher):
    """A bug raising inside one rank's engine thread: every rank's pending and later collectives fail naming that
    rank, from its own announcement (well inside a stall timeout set far above), and the job ends non-zero, under
    mpiexec and under ringtrain-run."""
    stall_s = MUST_END_S + 30
    # every rank must speak: under ringtrain-run too, one rank's exit makes hydra end the others
    job = run_job("engine_crash.py", n, where, speakers=n, ringtrain_run=launcher, RINGTRAIN_STALL_TIMEOUT_S=stall_s)
    assert job.returncode != 0, job
    assert job.seconds < MUST_END_S, job
    victim = n - 1
    planted_at = float(re.search(rf"rank {victim}: PLANTED at (\d+\.\d+)", job.output).group(1))
    for rank in range(n):
        line = job.caught(rank)
        assert line and f"ringtrain engine on rank {victim} crashed" in line and "planted bug" in line, job
        caught_at = float(re.search(rf"rank {rank}: CAUGHT-AT (\d+\.\d+)", job.output).group(1))
        assert caught_at - planted_at < 5.0, f"rank {rank} took {caught_at - planted_at:.1f} s to notice:\n{job}"
        assert f"rank {rank}: AFTER-CRASH RankFailureError" in job.output or (
            rank == victim and f"rank {rank}: AFTER-CRASH RingtrainError" in job.output), job
    _assert_no_leftovers(job.pids())
