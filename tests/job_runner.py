"""The jobs the launcher tests run (an mpiexec job of tests/parallel*, an example, a benchmark's quick run), two at a
time: while a test waits for its own job, the job of the next such test in the session already runs.

A job's ranks spend much of their time waiting (for a late peer a test made late on purpose, for a stall to be
detected, in start-up I/O), so one job alone keeps about one of CI's two cores busy; two at once keep both busy. Never
more than two: the jobs' own ranks already share the cores (4 ranks on 2).

A test asks for its job's result (`jobs.result(job)`, the session fixture `jobs` of tests/conftest.py) and checks
it. Its Job is the test's `job` parameter, so the runner knows from the session's collected items, before they run,
which jobs come and in what order; a test deselected with -k never starts one. A job starts ahead of its test only
while the tests before it run jobs too (or are quick checks in the same files): never beside the single-process
tests of other files, whose stall and timing cases run as they always did. Each job keeps its own hard
timeout, counted from its start: at that deadline its process group is killed and its result says so. Jobs still
running when the session ends (a test failed before waiting, -x) are killed then.
"""
import dataclasses
import importlib.util
import os
import signal
import subprocess
import threading
import time
from typing import Callable

MAX_AT_ONCE = 2
OUTPUT_TAIL_CHARS = 30000


@dataclasses.dataclass(frozen=True)
class Launch:
    """What a job runs: a command line, its environment and working directory. With stderr_apart its stderr goes
    to a file of its own (a benchmark's stdout is its table), else both go to the job's log."""
    command: list
    env: dict
    cwd: str
    stderr_apart: bool = False


@dataclasses.dataclass(frozen=True, eq=False)
class Job:
    """A subprocess job one test runs and checks. `launch(runner)` builds its Launch when it starts (directories
    from runner.directory: a working directory, a report directory, a cache shared with other jobs). `after`: jobs
    that must have ended before this one starts (a cache they fill). `requires`: modules that must be installed,
    else the job is never started ahead of its test (which then skips, or fails in CI)."""
    name: str
    launch: Callable
    timeout_s: float
    after: tuple = ()
    requires: tuple = ()

    def __repr__(self):
        return self.name


@dataclasses.dataclass
class Finished:
    """A job's outcome: returncode None when it ran past its timeout and was killed."""
    job: Job
    returncode: int
    elapsed_s: float
    output: str            # the last OUTPUT_TAIL_CHARS of its log: stdout, and stderr unless apart
    stderr: str            # with stderr_apart, the last OUTPUT_TAIL_CHARS of its stderr, else ''
    launch: Launch
    command: str
    log_path: str

    def text(self):
        """The whole log."""
        with open(self.log_path, errors="replace") as f:
            return f.read()


class Running:
    """A started job. A thread of its own waits for it and, at its deadline (timeout_s after its start), kills its
    process group: the deadline holds whether or not its test is waiting yet."""

    def __init__(self, job, launch, log_path):
        self.job, self.launch, self.log_path = job, launch, log_path
        self.started = time.monotonic()
        self.err_path = log_path[:-len(".log")] + ".stderr" if launch.stderr_apart else None
        with open(self.log_path, "wb") as log, open(self.err_path or os.devnull, "wb") as err:
            # own session: at the deadline we SIGKILL the group, and hydra's proxy then kills every rank
            self.proc = subprocess.Popen(launch.command, cwd=launch.cwd, env=launch.env, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=err if self.err_path else subprocess.STDOUT,
                                         start_new_session=True)
        self.returncode, self.ended, self.finished = None, None, None
        self.watcher = threading.Thread(target=self._watch, name=f"job {job.name}", daemon=True)
        self.watcher.start()

    def _watch(self):
        try:
            self.returncode = self.proc.wait(timeout=self.job.timeout_s)
        except subprocess.TimeoutExpired:
            self._kill_group()
            self.proc.wait()
        self.ended = time.monotonic()

    def _kill_group(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def running(self):
        return self.watcher.is_alive()

    def wait(self):
        if self.finished is None:
            self.watcher.join()
            self.finished = Finished(self.job, self.returncode, self.ended - self.started, _tail(self.log_path),
                                     _tail(self.err_path) if self.err_path else "", self.launch,
                                     " ".join(map(str, self.launch.command)), self.log_path)
        return self.finished

    def kill(self):
        if self.watcher.is_alive():
            self._kill_group()
            self.watcher.join()


class JobRunner:
    """Runs the session's jobs, at most MAX_AT_ONCE at a time. `runs`: lists of jobs in the order their tests run
    (jobs_in_order); a job starts ahead of its test only beside the earlier jobs of its own list. Directories and
    output logs lie under base_dir (the session's temporary directory)."""

    def __init__(self, runs, base_dir):
        self.runs = [list(run) for run in runs]
        self.base_dir = base_dir
        self.jobs = {}                 # Job -> Running

    def directory(self, name):
        """This session's directory `name`, made if new: one job's own (named for it), or one several jobs share."""
        path = os.path.join(self.base_dir, name)
        os.makedirs(path, exist_ok=True)
        return path

    def result(self, job):
        """Start `job` and the next ones (start), wait for `job`, at most until its deadline, and return its
        Finished."""
        return self.start(job).wait()

    def start(self, job):
        """Start `job` (once the jobs it comes after have ended) if it has not started, then the next jobs in order
        while fewer than MAX_AT_ONCE run. Returns its Running."""
        for before in job.after:
            if before in self.jobs:
                self.jobs[before].wait()
        own = self._start(job)
        run = next((run for run in self.runs if job in run), [job])
        for candidate in run[run.index(job) + 1:]:
            if sum(r.running() for r in self.jobs.values()) >= MAX_AT_ONCE:
                break
            if candidate not in self.jobs and self._ready(candidate):
                try:
                    self._start(candidate)
                except Exception:       # (cannot start here, say no mpiexec: its own test starts it and says why)
                    self.jobs.pop(candidate, None)
        return own

    def close(self):
        for running in self.jobs.values():
            running.kill()

    def _ready(self, job):
        if any(importlib.util.find_spec(name) is None for name in job.requires):
            return False
        return all(before in self.jobs and not self.jobs[before].running() for before in job.after
                   if any(before in run for run in self.runs))

    def _start(self, job):
        if job not in self.jobs:
            self.jobs[job] = Running(job, job.launch(self), os.path.join(self.base_dir, f"{job.name}.log"))
        return self.jobs[job]


def jobs_in_order(items):
    """The Job parameters of the collected test items in the order they run, as runs of consecutive job-running
    test files (a list of lists): a job starts ahead of its test only beside tests of files that run jobs
    themselves, never beside another file's single-process tests (a stall or timing test among them)."""
    def job_of(item):
        job = getattr(getattr(item, "callspec", None), "params", {}).get("job")
        return job if isinstance(job, Job) else None

    job_files = {str(item.path) for item in items if job_of(item) is not None}
    runs, seen = [[]], set()
    for item in items:
        if str(item.path) not in job_files:
            if runs[-1]:
                runs.append([])
            continue
        job = job_of(item)
        if job is not None and job not in seen:
            seen.add(job)
            runs[-1].append(job)
    return [run for run in runs if run]


def _tail(path):
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - OUTPUT_TAIL_CHARS))
        return f.read().decode(errors="replace")
