"""tests/job_runner.py: the launcher tests' jobs run two at a time, in their tests' order, each within its own
timeout, and none outlives the session. Jobs here are small shell commands."""
import os
import time
import types

import pytest

from job_runner import Job, JobRunner, Launch, jobs_in_order


def shell_job(name, script, timeout_s=60, **kwargs):
    """A job running `script` in sh, in its own directory of the session."""
    def launch(runner):
        return Launch(["sh", "-c", script], dict(os.environ), runner.directory(name))
    return Job(name, launch, timeout_s, **kwargs)


def gate_job(name, timeout_s=60, **kwargs):
    """A job that says it started, then waits until its directory holds a file 'go' (or its timeout)."""
    return shell_job(name, "echo started > started; while [ ! -e go ]; do sleep 0.01; done; echo done", timeout_s,
                     **kwargs)


def release(runner, name):
    with open(os.path.join(runner.directory(name), "go"), "w"):
        pass


def started(runner, name):
    return os.path.exists(os.path.join(runner.directory(name), "started"))


@pytest.fixture
def make_runner(tmp_path):
    runners = []

    def make(order):
        runners.append(JobRunner(order, str(tmp_path)))
        return runners[-1]
    yield make
    for runner in runners:
        runner.close()


def test_the_next_job_runs_beside_this_one_and_never_a_third(make_runner):
    a, b, c, d = gate_job("a"), gate_job("b"), gate_job("c"), gate_job("d")
    runner = make_runner([[a, b, c, d]])
    runner.start(a)
    assert set(runner.jobs) == {a, b}                       # a and b run; c waits for a free place
    release(runner, "a")
    done = runner.result(a)
    assert (done.returncode, done.output) == (0, "done\n")
    assert set(runner.jobs) == {a, b}                       # (the next place goes when b's test starts)
    runner.start(b)
    assert set(runner.jobs) == {a, b, c}                    # c beside b; d waits
    release(runner, "b")
    assert runner.result(b).returncode == 0
    runner.start(c)
    assert set(runner.jobs) == {a, b, c, d}
    release(runner, "c")
    assert runner.result(c).returncode == 0
    release(runner, "d")
    assert runner.result(d).returncode == 0


def test_a_job_waits_for_the_jobs_it_comes_after(make_runner):
    a = gate_job("a")
    b = shell_job("b", "echo b", after=(a,))
    c = gate_job("c")
    runner = make_runner([[a, b, c]])
    runner.jobs[a] = runner._start(a)               # a runs: b may not start beside it, c may
    assert runner._ready(c) and not runner._ready(b)
    release(runner, "a")
    assert runner.result(b).output == "b\n"          # waited for a, then ran
    assert runner.jobs[a].finished is not None and runner.jobs[a].finished.returncode == 0


def test_a_job_that_cannot_start_ahead_is_left_to_its_own_test(make_runner):
    def launch(runner):
        raise FileNotFoundError("no mpiexec")
    a, broken = shell_job("a", "echo a"), Job("broken", launch, 60)
    runner = make_runner([[a, broken]])
    assert runner.result(a).output == "a\n" and broken not in runner.jobs
    with pytest.raises(FileNotFoundError, match="no mpiexec"):
        runner.result(broken)


def test_a_jobs_stderr_goes_to_its_log_or_apart(make_runner):
    def job(name, apart):
        return Job(name, lambda runner: Launch(["sh", "-c", "echo out; echo err >&2; exit 3"], dict(os.environ),
                                               runner.directory(name), stderr_apart=apart), 60)
    together, apart = job("together", False), job("apart", True)
    runner = make_runner([[together, apart]])
    done = runner.result(together)
    assert (done.returncode, sorted(done.output.split()), done.stderr) == (3, ["err", "out"], "")
    done = runner.result(apart)
    assert (done.returncode, done.output, done.stderr, done.text()) == (3, "out\n", "err\n", "out\n")


def test_a_job_past_its_timeout_is_killed_with_its_children(make_runner):
    job = shell_job("slow", "sleep 60 & echo $! > child; wait", timeout_s=2)
    runner = make_runner([[job]])
    done = runner.result(job)
    assert done.returncode is None and "sleep 60" in done.command
    with open(os.path.join(runner.directory("slow"), "child")) as f:
        child = int(f.read())
    deadline = time.monotonic() + 30              # (a SIGKILLed process ends when next scheduled)
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def test_a_job_whose_module_is_missing_is_not_started_ahead_of_its_test(make_runner):
    a = shell_job("a", "true")
    b = gate_job("b", requires=("no_such_module_for_ringtrain_tests",))
    c = gate_job("c", requires=("json",))
    runner = make_runner([[a, b, c]])
    runner.result(a)
    assert b not in runner.jobs and c in runner.jobs


def test_jobs_still_running_at_the_end_are_killed(make_runner):
    a, b = shell_job("a", "true"), gate_job("b")
    runner = make_runner([[a, b]])
    runner.result(a)
    running = runner.jobs[b].proc
    runner.close()
    assert running.poll() is not None


def test_the_order_is_the_job_parameters_in_runs_of_job_running_files():
    a, b, c = shell_job("a", "true"), shell_job("b", "true"), shell_job("c", "true")

    def item(path, **params):
        return types.SimpleNamespace(path=path, callspec=types.SimpleNamespace(params=params))
    items = [item("test_x.py", job=b, num_ranks=2), item("test_x.py", x=1),        # a quick test beside the jobs
             types.SimpleNamespace(path="test_x.py"),                            # (not parametrized)
             item("test_y.py", job=a), item("test_y.py", job=b),
             item("test_z.py", x=2),                                             # another file's test: a new run
             item("test_w.py", job=c)]
    assert jobs_in_order(items) == [[b, a], [c]]


def test_a_job_starts_ahead_only_beside_its_own_run(make_runner):
    a, b, c = gate_job("a"), gate_job("b"), gate_job("c")
    runner = make_runner([[a], [b, c]])
    runner.start(a)
    assert set(runner.jobs) == {a}
    release(runner, "a")
    runner.result(a)
    runner.start(b)
    assert set(runner.jobs) == {a, b, c}
    release(runner, "b")
    release(runner, "c")
    assert runner.result(b).returncode == runner.result(c).returncode == 0


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
