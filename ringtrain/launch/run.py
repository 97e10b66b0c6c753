"""`ringtrain-run`: start a training script on N ranks through the mpiexec that came with this Python.

    ringtrain-run -np 4 python train.py --epochs 3
    ringtrain-run -np 8 --hostfile hosts -x NCCL_DEBUG=INFO python train.py
    ringtrain-run python train.py          # in an sbatch script or salloc shell: one rank per Slurm task

`mpirun -np 4 python train.py` works just as well; the launcher adds what plain mpiexec does not do:
- it uses the mpiexec installed beside this Python (pip's MPICH, the one mpi4py was paired with) before any on PATH;
- it gives each rank a fair share of the cores (OMP_NUM_THREADS = cores // ranks per host) unless you set it;
- each rank runs under a small wrapper, so a failing rank is named ("rank 1 exited with code 3") and the rest of the
  job is stopped after a grace period, even where MPI would wait forever for the dead rank;
- Ctrl-C / SIGTERM reach every rank, and whatever is still running after the grace period is killed;
- it exits non-zero when any rank failed;
- inside a Slurm allocation it starts hydra's proxies with srun (`-launcher slurm -rmk slurm`), takes -np from
  SLURM_NTASKS and threads from SLURM_CPUS_PER_TASK, and refuses to run as one of several srun tasks (which would
  start one whole job per task).

This file must keep to the standard library: it also runs as a plain script (`python -I run.py --rank-wrapper ...`)
inside every rank's wrapper, where importing the ringtrain package (and with it mpi4py's MPI_Init) would take the
rank's MPI connection away from the real program.
"""
import collections
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

PROG = "ringtrain-run"
RANK_WRAPPER_FLAG = "--rank-wrapper"

# The wrapper's report line; the launcher reads it back from the job's stderr. Keep both in sync.
FAILURE_LINE = re.compile(
    rb"^" + PROG.encode() + rb": rank (?P<rank>\d+) \(pid (?P<pid>\d+) on (?P<host>\S+)\) "
    rb"(?:exited with code (?P<code>\d+)|was killed by signal (?P<signame>\w+) \((?P<signum>\d+)\))")
# What MPICH's hydra prints when a process it started dies badly (it names the pid, not the rank).
HYDRA_BAD_PID = re.compile(rb"^=\s+PID (?P<pid>\d+) RUNNING AT (?P<host>\S+)")
HYDRA_EXIT_CODE = re.compile(rb"^=\s+EXIT CODE: (?P<code>\d+)")
# What MPICH prints when a rank calls MPI_Abort (mpi4py's runner does on an uncaught exception or sys.exit(N)).
MPICH_ABORT = re.compile(rb"Abort\((?P<code>\d+)\) on node \d+ \(rank (?P<rank>\d+) in comm 0\)")

# Environment variables each MPI sets to the process's world rank (hydra, Open MPI, PMIx, Slurm).
RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def _signal_name(signum):
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _exit_status(returncode):
    """Shell convention: a process killed by signal S is reported as 128 + S."""
    return 128 - returncode if returncode < 0 else returncode


# --------------------------------------------------------------------------------------------------------------
# Inside each rank: run the real command, report how it ended.

def _die_with_parent():
    """Runs in the child before exec: if the wrapper is SIGKILLed, the kernel kills the child too (Linux only)."""
    try:
        import ctypes
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except Exception:  # noqa: BLE001 -- best effort: other systems simply lack the safety net
        pass


def rank_from_environment():
    for name in RANK_VARIABLES:
        value = os.environ.get(name)
        if value is not None and value.strip().isdigit():
            return int(value)
    return None


def run_rank(command):
    """Run one rank's command as a child; forward signals to it; on failure print FAILURE_LINE and end the same way."""
    if not command:
        print(f"{PROG}: the rank wrapper needs a command", file=sys.stderr)
        return 2
    # close_fds=False: the MPI process manager hands the rank its connection as an inherited descriptor (PMI_FD).
    try:
        child = subprocess.Popen(command, close_fds=False, preexec_fn=_die_with_parent)
    except OSError as exc:
        print(f"{PROG}: rank {rank_from_environment()} on {socket.gethostname()} could not start "
              f"{command[0]!r}: {exc}", file=sys.stderr, flush=True)
        return 127

    def forward(signum, _frame):
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            pass

    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, forward)
    returncode = child.wait()
    if returncode == 0:
        return 0
    rank = rank_from_environment()
    where = f"rank {rank if rank is not None else '?'} (pid {child.pid} on {socket.gethostname()})"
    if returncode < 0:
        signum = -returncode
        print(f"{PROG}: {where} was killed by signal {_signal_name(signum)} ({signum})", file=sys.stderr, flush=True)
        # End the way the child did, so the MPI process manager sees a signal death and cleans up as it would.
        try:
            signal.signal(signum, signal.SIG_DFL)
        except (OSError, ValueError):
            pass                                # SIGKILL/SIGSTOP: never handled, already the default
        os.kill(os.getpid(), signum)
        return 128 + signum
    print(f"{PROG}: {where} exited with code {returncode}", file=sys.stderr, flush=True)
    return returncode


# --------------------------------------------------------------------------------------------------------------
# The launcher.

def find_mpiexec(explicit=None):
    """The mpiexec beside this Python (pip's MPICH lands in the venv's bin/), else the first one on PATH."""
    if explicit:
        return explicit
    beside_python = os.path.join(os.path.dirname(os.path.abspath(sys.executable)), "mpiexec")
    if os.access(beside_python, os.X_OK):
        return beside_python
    for name in ("mpiexec", "mpirun"):
        found = shutil.which(name)
        if found:
            return found
    raise SystemExit(f"{PROG}: no mpiexec found beside {sys.executable} or on PATH; "
                     f"`pip install mpich` or load your cluster's MPI module")


def mpi_flavor(mpiexec):
    """'hydra' (MPICH, Intel MPI, MVAPICH), 'openmpi', or 'unknown': their flags for env and hostfile differ."""
    try:
        text = subprocess.run([mpiexec, "--version"], capture_output=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if b"HYDRA" in text or b"Intel(R) MPI" in text:
        return "hydra"
    if b"Open MPI" in text or b"OpenRTE" in text or b"open-mpi" in text:
        return "openmpi"
    return "unknown"


def count_hosts(hostfile):
    """Distinct hosts named in a hostfile ('host', 'host:slots' or 'host slots=N' lines; '#' starts a comment)."""
    hosts = set()
    with open(hostfile) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                hosts.add(line.split()[0].split(":")[0])
    return max(1, len(hosts))


def usable_cores():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def threads_per_rank(num_ranks, num_hosts=1, cores=None):
    """Share this host's cores among the ranks it will run, at least one thread each."""
    ranks_here = math.ceil(num_ranks / num_hosts)
    return max(1, (cores or usable_cores()) // max(1, ranks_here))


def parse_exports(specs, environ):
    """-x VAR (take its value from here) or -x VAR=value -> {VAR: value}."""
    exports = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        if not name or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise SystemExit(f"{PROG}: -x {spec!r} is not VAR or VAR=value")
        if not sep:
            if name not in environ:
                raise SystemExit(f"{PROG}: -x {name}: {name} is not set in this environment; use -x {name}=value")
            value = environ[name]
        exports[name] = value
    return exports


PYTHON_NAME = re.compile(r"^python[0-9.]*$")
PYTHON_OPTIONS_WITH_VALUE = ("-W", "-X", "--check-hash-based-pycs")


def abort_on_exception(command):
    """`python [opts] script.py ...` -> `python [opts] -m mpi4py script.py ...` (likewise `-m module`, `-c code`).

    Under plain python, a rank whose script raises (or sys.exit(3)s) runs MPI_Finalize at exit and waits there for
    ranks that are themselves waiting for it: the job hangs. mpi4py's runner calls MPI_Abort instead, so the whole
    job ends at once with the rank's exit status. Commands that are not a python script are left alone."""
    if not command or not PYTHON_NAME.match(os.path.basename(command[0])):
        return list(command)
    i = 1
    while i < len(command):
        arg = command[i]
        if arg in ("-m", "-c") or not arg.startswith("-"):
            if arg == "-m" and i + 1 < len(command) and command[i + 1] == "mpi4py":
                return list(command)           # already there
            return list(command[:i]) + ["-m", "mpi4py"] + list(command[i:])
        if arg == "-":
            break                              # script from stdin: mpi4py's runner cannot take it
        if arg in PYTHON_OPTIONS_WITH_VALUE:
            i += 1
        i += 1
    return list(command)


# How to launch inside a Slurm allocation (see slurm_plan); threads_per_rank is None when Slurm does not say.
SlurmPlan = collections.namedtuple("SlurmPlan", "num_ranks mpiexec_args num_hosts threads_per_rank")


def _slurm_int(environ, *names):
    for name in names:
        value = environ.get(name, "").split("(")[0].strip()      # SLURM_TASKS_PER_NODE style "4(x2)" -> 4
        if value.isdigit():
            return int(value)
    return None


def slurm_plan(environ, flavor, num_ranks=None, hostfile=None):
    """Pure: None outside a Slurm allocation (no SLURM_JOB_ID), else a SlurmPlan from the allocation's variables.

    Inside an sbatch script or salloc shell, hydra's slurm launcher starts one proxy per node with srun and reads the
    nodes and tasks per node from SLURM_JOB_NODELIST / SLURM_TASKS_PER_NODE; Open MPI's mpirun reads the allocation
    itself. An explicit --hostfile wins over the allocation. Under `srun -n N ringtrain-run ...` there would be N
    launchers each starting a whole job: refused with the command that works."""
    if not environ.get("SLURM_JOB_ID"):
        return None
    step_tasks = _slurm_int(environ, "SLURM_STEP_NUM_TASKS")
    if (environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID")) is not None and (step_tasks or 1) > 1:
        raise SystemExit(f"{PROG}: this is task {environ.get('SLURM_PROCID', '?')} of an srun step of {step_tasks} "
                         f"tasks, so {step_tasks} launchers would each start a whole job. Run {PROG} once per "
                         f"allocation -- in the sbatch script or the salloc shell: `{PROG} python train.py` "
                         f"(one rank per Slurm task) -- not under srun")
    if num_ranks is None:
        num_ranks = _slurm_int(environ, "SLURM_NTASKS", "SLURM_NPROCS")
        if num_ranks is None:
            raise SystemExit(f"{PROG}: -np is required: the Slurm allocation does not say how many tasks it holds "
                             f"(SLURM_NTASKS is unset; allocate with --ntasks or pass -np)")
    args = ["-launcher", "slurm", "-rmk", "slurm"] if flavor == "hydra" and not hostfile else []
    return SlurmPlan(num_ranks, args, _slurm_int(environ, "SLURM_JOB_NUM_NODES", "SLURM_NNODES") or 1,
                     _slurm_int(environ, "SLURM_CPUS_PER_TASK"))


def build_command(mpiexec, flavor, num_ranks, command, hostfile=None, exports=None, wrap_ranks=True,
                  abort_on_error=True, launcher_args=()):
    cmd = [mpiexec, "-n", str(num_ranks), *launcher_args]
    if hostfile:
        cmd += ["--hostfile" if flavor == "openmpi" else "-f", hostfile]
    for name, value in (exports or {}).items():
        if flavor == "hydra":
            cmd += ["-genv", name, value]
        elif flavor == "openmpi":
            cmd += ["-x", f"{name}={value}"]
        # unknown: the variable is in the environment mpiexec inherits, which local launches pass on
    if abort_on_error:
        command = abort_on_exception(command)
    if wrap_ranks:
        # -I: the wrapper must not see PYTHONPATH or run.py's own directory (ringtrain/ would shadow modules)
        command = [sys.executable, "-I", os.path.abspath(__file__), RANK_WRAPPER_FLAG, "--"] + list(command)
    return cmd + list(command)


class JobOutput:
    """Copies the job's stderr to ours as it arrives and notes which ranks the wrappers (or hydra) said failed."""

    def __init__(self, stream, sink):
        self.stream = stream
        self.sink = sink
        self.failures = {}          # rank (or 'pid N') -> how it ended, in the order seen
        self.first_failure_at = None
        self.hydra_pids = []
        self.hydra_codes = []
        self._pending = b""
        self._thread = threading.Thread(target=self._pump, name="ringtrain-run-stderr", daemon=True)
        self._thread.start()

    def _pump(self):
        fd = self.stream.fileno()
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            self.sink.write(chunk)
            self.sink.flush()
            self._scan(chunk)
        if self._pending:
            self._scan(b"\n")

    def _scan(self, chunk):
        lines = (self._pending + chunk).split(b"\n")
        self._pending = lines.pop()[-4096:]    # a partial line waits for the rest; progress bars never end one
        for line in lines:
            line = line.rstrip(b"\r")
            match = FAILURE_LINE.match(line)
            if match:
                rank = int(match["rank"])
                if match["code"] is not None:
                    how = f"exited with code {int(match['code'])}"
                    status = int(match["code"])
                else:
                    how = f"was killed by signal {match['signame'].decode()} ({int(match['signum'])})"
                    status = 128 + int(match["signum"])
                self._record(rank, how, status)
                continue
            match = MPICH_ABORT.search(line)
            if match:
                self._record(int(match["rank"]), f"called MPI_Abort with code {int(match['code'])}",
                             int(match["code"]))
                continue
            match = HYDRA_BAD_PID.match(line)
            if match:
                self.hydra_pids.append((int(match["pid"]), match["host"].decode()))
                continue
            match = HYDRA_EXIT_CODE.match(line)
            if match:
                self.hydra_codes.append(int(match["code"]))

    def _record(self, rank, how, status):
        self.failures.setdefault(rank, (how, status))
        if self.first_failure_at is None:
            self.first_failure_at = time.monotonic()

    def join(self, timeout):
        self._thread.join(timeout)


class Job:
    """mpiexec in its own session: the terminal's Ctrl-C reaches only us, and we decide what the ranks get."""

    def __init__(self, cmd, env, grace_s):
        self.grace_s = grace_s
        self.stop_signal = None       # the signal that asked us to stop, if one did
        self.stop_sent_at = None      # when we last asked mpiexec to stop; SIGKILL follows after grace_s
        self.killed = False
        self.process = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, start_new_session=True)
        self.output = JobOutput(self.process.stderr, sys.stderr.buffer)

    def on_signal(self, signum, _frame):
        if self.stop_signal is not None and signum in (signal.SIGINT, signal.SIGTERM):
            self.kill()                                   # asked twice: no more patience
            return
        if signum in (signal.SIGINT, signal.SIGTERM):
            self.stop_signal = signum
            self.stop_sent_at = time.monotonic()
        self._send(signum)                                # hydra passes it on to every rank

    def _send(self, signum):
        try:
            os.kill(self.process.pid, signum)
        except ProcessLookupError:
            pass

    def kill(self):
        """SIGKILL mpiexec's whole group; hydra's proxies notice and SIGKILL the ranks (they run in their own
        sessions, out of our reach)."""
        if not self.killed:
            self.killed = True
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait(self):
        while True:
            try:
                return self.process.wait(timeout=0.1)
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if self.stop_sent_at is not None and now - self.stop_sent_at > self.grace_s:
                print(f"{PROG}: ranks still running {self.grace_s:g} s after they were asked to stop; killing them",
                      file=sys.stderr, flush=True)
                self.kill()
                self.stop_sent_at = None
            elif (self.stop_sent_at is None and not self.killed and self.output.first_failure_at is not None
                  and now - self.output.first_failure_at > self.grace_s):
                ranks = ", ".join(str(r) for r in self.output.failures)
                print(f"{PROG}: rank(s) {ranks} failed {self.grace_s:g} s ago and the job is still running; "
                      f"stopping the other ranks", file=sys.stderr, flush=True)
                self.stop_sent_at = now
                self._send(signal.SIGTERM)


def summarize(job, returncode):
    """Print which ranks failed and how; return the launcher's exit status (non-zero when anything failed)."""
    failures = job.output.failures
    for rank, (how, _status) in sorted(failures.items()):
        print(f"{PROG}: rank {rank} {how}", file=sys.stderr)
    if job.stop_signal is not None:
        # the ranks' deaths above (if any) are the consequence of the signal, not the cause
        print(f"{PROG}: job stopped by {_signal_name(job.stop_signal)}", file=sys.stderr, flush=True)
        return 128 + job.stop_signal
    if failures:
        print(f"{PROG}: job failed: {len(failures)} rank(s) failed ({', '.join(map(str, sorted(failures)))})",
              file=sys.stderr, flush=True)
        status = next(iter(failures.values()))[1]
        return status if status != 0 else 1
    if returncode != 0:
        detail = ""
        if job.output.hydra_pids:
            pid, host = job.output.hydra_pids[0]
            code = job.output.hydra_codes[0] if job.output.hydra_codes else "?"
            detail = f" (mpiexec reports pid {pid} on {host} ended with exit code {code})"
        print(f"{PROG}: job failed: mpiexec exited with status {_exit_status(returncode)}{detail}",
              file=sys.stderr, flush=True)
        return _exit_status(returncode) or 1
    return 0


def launch(argv):
    from .options import parse_args      # (not at the top: a rank's wrapper runs this file as a plain script)
    from .. import doctor
    args = parse_args(argv, PROG)
    mpiexec = find_mpiexec(args.mpiexec)
    flavor = mpi_flavor(mpiexec)
    env = dict(os.environ)
    exports = parse_exports(args.exports, env)
    slurm = slurm_plan(env, flavor, args.num_ranks, args.hostfile)
    num_ranks = slurm.num_ranks if slurm else args.num_ranks
    if num_ranks is None:
        raise SystemExit(f"{PROG}: -np N is required (outside a Slurm allocation nothing else says how many ranks)")
    if "OMP_NUM_THREADS" not in env and "OMP_NUM_THREADS" not in exports:
        num_hosts = count_hosts(args.hostfile) if args.hostfile else slurm.num_hosts if slurm else 1
        threads = slurm and slurm.threads_per_rank
        exports["OMP_NUM_THREADS"] = str(threads or threads_per_rank(num_ranks, num_hosts))
    flight_dir, ours = doctor.job_directory(env)     # every rank's flight recorder, merged after the job
    exports["RINGTRAIN_FLIGHT_RECORDER_DIR"] = flight_dir
    env.update(exports)
    if args.elastic:
        return launch_elastic(args, mpiexec, env)
    hosts_args = () if not args.hosts else ("-hosts" if flavor == "hydra" else "--host", args.hosts)
    cmd = build_command(mpiexec, flavor, num_ranks, args.command, args.hostfile, exports, args.wrap_ranks,
                        args.abort_on_error, tuple(slurm.mpiexec_args if slurm else ()) + hosts_args)
    try:
        job = Job(cmd, env, args.grace)
    except OSError as exc:
        raise SystemExit(f"{PROG}: could not start {mpiexec}: {exc}") from None
    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, job.on_signal)
    try:
        returncode = job.wait()
    except BaseException:
        job.kill()        # never leave a job behind because the launcher itself broke
        raise
    job.output.join(timeout=5)
    status = summarize(job, returncode)
    doctor.after_job(flight_dir, ours, prog=PROG)
    return status


def launch_elastic(args, mpiexec, env):
    """The elastic driver (ringtrain/launch/elastic_driver.py) starts and re-forms the workers; it never starts MPI here."""
    from .elastic_driver import ElasticDriver
    driver = ElasticDriver(args.command, env, mpiexec, args.num_ranks, min_np=args.min_np, max_np=args.max_np,
                           hosts=args.hosts, discovery_script=args.host_discovery_script, slots=args.slots,
                           reset_limit=args.reset_limit, elastic_timeout_s=args.elastic_timeout,
                           cooldown_range=args.blacklist_cooldown_range)
    def stop(signum, _frame):
        raise SystemExit(128 + signum)     # the driver stops every worker on its way out

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, stop)
    return driver.run()


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [RANK_WRAPPER_FLAG]:
        command = argv[1:]
        if command[:1] == ["--"]:
            command = command[1:]
        sys.exit(run_rank(command))
    sys.exit(launch(argv))


if __name__ == "__main__":
    main()
