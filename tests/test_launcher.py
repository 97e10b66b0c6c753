"""ringtrain-run: real 2- and 3-rank jobs through mpiexec (tiny mpi4py scripts, no ringtrain core), plus its pieces.

Every job runs under a hard timeout and is killed in `finally`, so a broken launcher fails these tests, never hangs them.
"""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from ringtrain.launch import run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(REPO, "tests", "launcher_scripts")
JOB_TIMEOUT_S = 60


def launcher_env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("OMP_NUM_THREADS", None)
    env.update(extra)
    return env


def start_launcher(args, **env):
    return subprocess.Popen([sys.executable, "-m", "ringtrain.launch.run"] + args, env=launcher_env(**env),
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def stop(proc):
    """Politely (the launcher stops its job), then firmly."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_launcher(args, timeout=JOB_TIMEOUT_S, **env):
    proc = start_launcher(args, **env)
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")
    finally:
        stop(proc)


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except FileNotFoundError:
        return False


def wait_for_pid_files(directory, count, proc, timeout=JOB_TIMEOUT_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        names = [n for n in os.listdir(directory) if n.endswith(".pid")]
        if len(names) == count:
            return [int(open(os.path.join(directory, n)).read()) for n in sorted(names)]
        if proc.poll() is not None:
            raise AssertionError(f"launcher exited with {proc.returncode} before the ranks started: "
                                 f"{proc.stderr.read().decode(errors='replace')}")
        time.sleep(0.05)
    raise AssertionError(f"only {names} of {count} ranks wrote their pid within {timeout} s")


def kill_leftovers(pids):
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


# ---------------------------------------------------------------------------------------------------- real jobs

def test_two_ranks_succeed_with_exported_variable_and_fair_threads():
    code, out, err = run_launcher(["-np", "2", "-x", "RINGTRAIN_LAUNCHER_TEST=yes",
                                   sys.executable, os.path.join(SCRIPTS, "hello.py")])
    assert code == 0, err
    threads = max(1, run.usable_cores() // 2)
    for rank in (0, 1):
        assert (f"hello from rank {rank} of 2 OMP_NUM_THREADS={threads} RINGTRAIN_LAUNCHER_TEST=yes") in out, out


def test_user_thread_setting_is_kept():
    code, out, err = run_launcher(["-np", "2", sys.executable, os.path.join(SCRIPTS, "hello.py")],
                                  OMP_NUM_THREADS="7")
    assert code == 0, err
    assert out.count("OMP_NUM_THREADS=7 ") == 2, out


def test_crashed_rank_is_named_and_job_fails():
    start = time.monotonic()
    code, _out, err = run_launcher(["-np", "2", "--grace", "2", sys.executable,
                                    os.path.join(SCRIPTS, "rank_exits.py"), "1", "3", "crash"])
    assert code != 0, err
    assert "ringtrain-run: rank 1 " in err and "rank(s) failed (1)" in err, err
    assert time.monotonic() - start < 30


def test_rank_exiting_cleanly_with_error_code_ends_job_with_that_code():
    # sys.exit(3) would leave the other ranks (and MPI_Finalize) waiting forever under plain mpiexec
    start = time.monotonic()
    code, _out, err = run_launcher(["-np", "3", "--grace", "2", sys.executable,
                                    os.path.join(SCRIPTS, "rank_exits.py"), "2", "3", "exit"])
    assert code == 3, err
    assert "ringtrain-run: rank 2 " in err and "failed (2)" in err, err
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_launcher_stops_every_rank(tmp_path, signum):
    proc = start_launcher(["-np", "2", "--grace", "3", sys.executable,
                           os.path.join(SCRIPTS, "sleep_forever.py"), str(tmp_path)])
    pids = []
    try:
        pids = wait_for_pid_files(str(tmp_path), 2, proc)
        sent = time.monotonic()
        proc.send_signal(signum)
        code = proc.wait(timeout=20)
        deadline = sent + 5
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in pids if alive(p)], f"ranks {pids} still alive 5 s after {signum!r}"
        assert code != 0
        assert f"stopped by {signal.Signals(signum).name}" in proc.stderr.read().decode(errors="replace")
    finally:
        stop(proc)
        kill_leftovers(pids)


def test_ranks_ignoring_sigterm_are_killed_after_grace(tmp_path):
    proc = start_launcher(["-np", "2", "--grace", "1", sys.executable,
                           os.path.join(SCRIPTS, "sleep_forever.py"), str(tmp_path), "ignore-sigterm"])
    pids = []
    try:
        pids = wait_for_pid_files(str(tmp_path), 2, proc)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=20)
        deadline = time.monotonic() + 5
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in pids if alive(p)], f"stubborn ranks {pids} outlived the grace period"
        assert code != 0
        assert "killing them" in proc.stderr.read().decode(errors="replace")
    finally:
        stop(proc)
        kill_leftovers(pids)


def test_missing_command_is_a_usage_error():
    code, _out, err = run_launcher(["-np", "2"])
    assert code == 2 and "no command given" in err


# ---------------------------------------------------------------------------------------------------- the pieces

def test_rank_wrapper_reports_exit_code_in_the_format_the_launcher_reads():
    env = dict(os.environ, PMI_RANK="5")
    proc = subprocess.run([sys.executable, "-I", run.__file__, run.RANK_WRAPPER_FLAG, "--",
                           sys.executable, "-c", "import sys; sys.exit(4)"],
                          env=env, capture_output=True, timeout=JOB_TIMEOUT_S)
    assert proc.returncode == 4
    match = run.FAILURE_LINE.match(proc.stderr.strip())
    assert match and match["rank"] == b"5" and match["code"] == b"4", proc.stderr


def test_rank_wrapper_dies_by_the_signal_that_killed_its_rank():
    env = dict(os.environ, PMI_RANK="2")
    proc = subprocess.run([sys.executable, "-I", run.__file__, run.RANK_WRAPPER_FLAG, "--", sys.executable, "-c",
                           "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
                          env=env, capture_output=True, timeout=JOB_TIMEOUT_S)
    assert proc.returncode == -signal.SIGKILL
    match = run.FAILURE_LINE.match(proc.stderr.strip())
    assert match and match["rank"] == b"2" and match["signame"] == b"SIGKILL", proc.stderr


def test_rank_wrapper_passes_success_through_silently():
    proc = subprocess.run([sys.executable, "-I", run.__file__, run.RANK_WRAPPER_FLAG, "--",
                           sys.executable, "-c", "print('ok')"], capture_output=True, timeout=JOB_TIMEOUT_S)
    assert (proc.returncode, proc.stdout.strip(), proc.stderr) == (0, b"ok", b"")


@pytest.mark.parametrize("command, expected", [
    (["python", "train.py", "--lr", "0.1"], ["python", "-m", "mpi4py", "train.py", "--lr", "0.1"]),
    (["python3.11", "-u", "-W", "ignore", "train.py"], ["python3.11", "-u", "-W", "ignore", "-m", "mpi4py", "train.py"]),
    (["/venv/bin/python", "-m", "pkg.train"], ["/venv/bin/python", "-m", "mpi4py", "-m", "pkg.train"]),
    (["python", "-c", "print(1)"], ["python", "-m", "mpi4py", "-c", "print(1)"]),
    (["python", "-m", "mpi4py", "train.py"], ["python", "-m", "mpi4py", "train.py"]),
    (["./train.sh", "x"], ["./train.sh", "x"]),
    (["python", "-"], ["python", "-"]),
])
def test_abort_on_exception_rewrites_only_python_scripts(command, expected):
    assert run.abort_on_exception(command) == expected


def test_build_command_uses_each_mpis_own_flags(tmp_path):
    hostfile = str(tmp_path / "hosts")
    hydra = run.build_command("mpiexec", "hydra", 4, ["./a.out"], hostfile, {"A": "1"}, wrap_ranks=False)
    assert hydra == ["mpiexec", "-n", "4", "-f", hostfile, "-genv", "A", "1", "./a.out"]
    ompi = run.build_command("mpirun", "openmpi", 2, ["./a.out"], hostfile, {"A": "1"}, wrap_ranks=False)
    assert ompi == ["mpirun", "-n", "2", "--hostfile", hostfile, "-x", "A=1", "./a.out"]
    wrapped = run.build_command("mpiexec", "hydra", 2, ["python", "t.py"])
    assert wrapped[3:] == [sys.executable, "-I", run.__file__, run.RANK_WRAPPER_FLAG, "--",
                           "python", "-m", "mpi4py", "t.py"]


def test_threads_per_rank_shares_cores_per_host():
    assert run.threads_per_rank(4, cores=16) == 4
    assert run.threads_per_rank(3, cores=2) == 1
    assert run.threads_per_rank(8, num_hosts=2, cores=16) == 4
    assert run.threads_per_rank(1, cores=2) == 2


def test_count_hosts_reads_hydra_and_openmpi_formats(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# cluster\nnode1:4\nnode2 slots=4\n\nnode1\n")
    assert run.count_hosts(str(path)) == 2


def test_parse_exports():
    assert run.parse_exports(["A=1", "B", "C=x=y"], {"B": "from-env"}) == {"A": "1", "B": "from-env", "C": "x=y"}
    with pytest.raises(SystemExit, match="MISSING is not set"):
        run.parse_exports(["MISSING"], {})
    with pytest.raises(SystemExit, match="not VAR or VAR=value"):
        run.parse_exports(["1BAD=2"], {})


def test_find_mpiexec_prefers_the_one_beside_python():
    found = run.find_mpiexec()
    beside = os.path.join(os.path.dirname(os.path.abspath(sys.executable)), "mpiexec")
    if os.access(beside, os.X_OK):
        assert found == beside
    assert os.access(found, os.X_OK)


def test_python_dash_m_ringtrain_is_the_launcher():
    proc = subprocess.run([sys.executable, "-m", "ringtrain", "--help"], env=launcher_env(), stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: ringtrain-run -np N")


@pytest.mark.parametrize("flags, message", [
    (["--min-np", "2"], "an elastic job needs -np"),
    (["-np", "2", "--min-np", "3"], r"need 1 <= --min-np \(3\) <= -np \(2\) <= --max-np \(None\)"),
    (["-np", "4", "--min-np", "2", "--max-np", "3"], r"-np \(4\) <= --max-np \(3\)"),
    (["-np", "2", "--min-np", "0"], r"need 1 <= --min-np \(0\)"),
    (["-np", "2", "--min-np", "1", "-H", "a:2", "--host-discovery-script", "/bin/true"], "not both"),
    (["-np", "2", "--host-discovery-script", os.path.abspath(__file__)], "is not an executable file"),
    (["-np", "2", "--min-np", "1", "--blacklist-cooldown-range", "5", "1"], "needs 0 <= MIN <= MAX"),
])
def test_elastic_flags_that_cannot_work_are_usage_errors(flags, message, capsys):
    from ringtrain.launch.options import parse_args
    with pytest.raises(SystemExit) as error:
        parse_args(flags + ["python", "train.py"], prog="ringtrain-run")
    assert error.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_elastic_flags_that_work_make_an_elastic_job():
    from ringtrain.launch.options import parse_args
    args = parse_args(["-np", "3", "--min-np", "2", "--max-np", "4", "python", "train.py"], prog="ringtrain-run")
    assert args.elastic and args.command == ["python", "train.py"]
    assert not parse_args(["-np", "3", "-H", "a:3", "python", "train.py"], prog="ringtrain-run").elastic
