"""The elastic driver's worker processes: starting each worker as its own 1-rank MPI job with the driver's address
in its environment, and stopping them.

    processes = WorkerProcesses(command, env, mpiexec, driver_port)
    worker = processes.start(host, slot, now)        # a Worker (its connection comes later, elastic_channel.py)
    processes.stop_all(workers)                      # SIGTERM, then SIGKILL after a grace period

Standard library only: the driver runs in the launcher, which must not start MPI.
"""
import dataclasses
import os
import signal
import socket
import subprocess

from ..world.elastic_protocol import DRIVER_VARIABLE, HOST_VARIABLE, SLOT_VARIABLE, WORKER_VARIABLE, LineReader
from .child import die_with_parent

STOP_GRACE_S = 5.0
LOCAL_HOSTS = ("localhost", "127.0.0.1", socket.gethostname())


@dataclasses.dataclass(eq=False)
class Worker:
    id: str
    host: str
    slot: int
    process: subprocess.Popen
    started_at: float
    conn: socket.socket = None
    reader: LineReader = None
    ready_at: float = None          # asked for a world and has not got one yet
    rank: int = None                # in the current world
    generation: int = None          # the world it belongs to
    gone: bool = False              # dead or finished (process ended or connection lost)
    removed: bool = False           # its slot left the host list: it leaves at the next step boundary
    exiting: bool = False           # said it is leaving normally (its connection closing is then no death)
    held_state: bool = False        # was a member of a formed world (holds the training state while alive)
    status: str = ""

    def label(self):
        return f"{self.host}[{self.slot}]"


def is_local(host):
    return host in LOCAL_HOSTS or host.startswith("127.")


def names_sockets(provider):
    """Whether libfabric's FI_PROVIDER value lets it pick the sockets provider (a list of names, ';' layering
    them; a leading '^' excludes the names)."""
    names = [name.strip().lower() for part in provider.split(",") for name in part.split(";")]
    return not provider.strip().startswith("^") and "sockets" in names


class WorkerProcesses:
    def __init__(self, command, env, mpiexec, driver_port):
        self.command, self.env, self.mpiexec = list(command), dict(env), mpiexec
        # libfabric's sockets provider, set by the user: its elastic workers abort on a dead peer's endpoint (as
        # the default pick does) and, at 4 workers on one machine, trained to the end but never exited (measured
        # here; 2 workers exited): the workers get the tcp provider instead, and the driver says so (`notice`)
        self.notice = None
        if names_sockets(self.env.get("FI_PROVIDER", "")):
            self.notice = (f"FI_PROVIDER={self.env['FI_PROVIDER']} is replaced by FI_PROVIDER=tcp for the elastic "
                           f"workers: with libfabric's sockets provider a worker that meets a dead peer's endpoint "
                           f"is aborted by MPICH, and finished workers do not exit")
            self.env["FI_PROVIDER"] = "tcp"
        self.driver_port = driver_port
        self.counter = 0

    def start(self, host, slot, now):
        self.counter += 1
        worker_id = f"{host}[{slot}]#{self.counter}"
        env = dict(self.env)
        # UCX's cross-memory-attach transport (pip's MPICH uses it for large messages between processes of one
        # machine) kills the process reading from a peer that died mid-message ("process_vm_readv ... No such
        # process"), survivor included: measured here, 2 runs in 6 at 2 workers with 7.6 MB of gradients
        env.setdefault("UCX_TLS", "^cma")
        # MPICH's ucx module crashes a survivor that sends to a worker that just died (a segmentation fault inside
        # MPI_Isend: after the failed send it writes to the request it never created), and a send can leave before
        # the driver's word of the death arrives; its ofi module returns an error. Measured here: ofi's allreduces
        # are faster between the separately started processes of an elastic world; ofi moves data only inside MPI
        # calls, so the engine's waits probe MPI in elastic worlds (engine/control.py, ControlChannel.progress).
        env.setdefault("MPIR_CVAR_CH4_NETMOD", "ofi")
        # libfabric's tcp provider named alone (not the default pick, which layers it under the rxm utility
        # provider): a survivor's pending operation with a worker that died then simply never completes (the
        # watchdog and the driver's word end the wait), where the default reported a completion-queue error that
        # MPICH's ofi module turns into an abort of the survivor, whatever the error handler. Measured here: a
        # peer SIGKILLed mid-exchange aborted the survivor 4 times in 4 with the default, 0 in 4 with tcp.
        env.setdefault("FI_PROVIDER", "tcp")
        # no MPI_Finalize at exit: what the worlds a worker left hold stays allocated (they are abandoned, not freed:
        # elastic/runner.py), and with the tcp provider MPICH's finalize then fails to close the fabric ("Device or
        # resource busy") and aborts the finished worker (exit code 15). mpi4py reads this at its import.
        env.setdefault("MPI4PY_RC_FINALIZE", "false")
        env.update({DRIVER_VARIABLE: f"{'127.0.0.1' if is_local(host) else _address()}:{self.driver_port}",
                    WORKER_VARIABLE: worker_id, HOST_VARIABLE: host, SLOT_VARIABLE: str(slot),
                    "RINGTRAIN_ELASTIC": "1",
                    "HOROVOD_HOSTNAME": host, "HOROVOD_LOCAL_RANK": str(slot)})
        cmd = [self.mpiexec, "-n", "1"] + ([] if is_local(host) else ["-hosts", host]) + self.command
        process = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=die_with_parent)
        return Worker(worker_id, host, slot, process, now)

    @staticmethod
    def exit_status(worker):
        """None while it runs; else its exit code (negative: the signal)."""
        return worker.process.poll()

    @staticmethod
    def stop_all(workers):
        import time
        running = [w for w in workers if w.process.poll() is None]
        for worker in running:
            kill_group(worker.process, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for worker in running:
            try:
                worker.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill_group(worker.process, signal.SIGKILL)
                worker.process.wait()


def kill_group(process, signum):
    try:
        os.killpg(process.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def signal_name(signum):
    try:
        return f"{signal.Signals(signum).name} ({signum})"
    except ValueError:
        return f"signal {signum}"


def _address():
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
