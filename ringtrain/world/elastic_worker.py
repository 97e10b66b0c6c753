"""The worker side of an elastic job: its connection to the driver, and forming each new world.

    comm = elastic_world(timeout_s)       # in init(), when the driver's variable is set

One connection per process, kept across worlds. A reader thread takes the driver's notifications as they come:
`peer_failed` ends every wait of the current world at once (watchdog.abort_all: the engines fail on their own
threads, so the training thread sees RankFailureError -- hvd.elastic.run rolls back and re-forms); `hosts_updated` is queued
for the next State.check_host_updates(). Replies the rendezvous waits for go to a queue.

Forming a world of n (the driver's plan, ranks in the order it chose): rank 0 opens an MPI port and tells the driver;
the driver tells one joiner at a time to Connect (MPICH crashed here with several Connects pending at once), and
each Accept + Merge grows the world by one with every member taking part (launchers/dynamic.py). A final Split
orders it by the planned rank. Survivors of the last world keep their process and their memory: only the
communicator is new.

Before any MPI call, a barrier over the driver's connections: each planned worker answers the plan ("planned") and
waits for "go", which the driver sends once every one of them answered; if one dies before that, the driver sends
"abandon" instead and every worker asks again ("ready"), so a death there costs a re-plan, not the job. (Once the
MPI Accept/Connect has begun, nothing can interrupt it: a death then still ends the job.)

A survivor that cannot leave a failed world must not hold the others: MPICH's ofi network module aborts a process on
a completion-queue error (a dead peer's endpoint) whatever the error handler, and MPI_Abort can then hang. So the
driver's word of a death starts a leave watchdog: a worker that has not asked for the next world within
RINGTRAIN_ELASTIC_LEAVE_TIMEOUT_S (30 s; a step that computes longer than that without a collective needs more)
prints where its main thread is and exits with status 1: the driver counts it as one more death, and the others
re-form without it.
"""
import atexit
import os
import queue
import socket
import sys
import threading
import time
import traceback

from ..errors import RankFailureError
from ..engine.watchdog import abort_all
from ..errors import ElasticError
from .elastic_protocol import (DRIVER_VARIABLE, LEAVE_TIMEOUT_VARIABLE, SLOT_VARIABLE,
                               WORKER_VARIABLE, LineReader, encode, leave_timeout_s)

_client = None
_client_lock = threading.Lock()


def enabled(environ=os.environ):
    return bool(environ.get(DRIVER_VARIABLE))


def slot(environ=os.environ):
    """This elastic worker's slot on its host (None outside an elastic job). Its GPU is chosen by slot, not by
    local rank: every worker starts as a launch of its own, and its place in a world changes from world to world,
    while its slot -- and the GPU it holds memory on -- does not."""
    value = environ.get(SLOT_VARIABLE)
    return int(value) if enabled(environ) and value is not None else None


class DriverClient:
    def __init__(self, address, worker_id):
        host, _, port = address.rpartition(":")
        self.worker_id = worker_id
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        self.sock.settimeout(None)
        self.replies = queue.Queue()
        self.host_updates = queue.Queue()       # (seq, added, removed) for State.check_host_updates()
        self.generation = None                  # the world this process is in now
        self.failed_generations = set()
        self.closed = False
        self.asked = 0                          # how many times this process asked for a world ("ready")
        self.in_world = False                   # between a world's formation and asking for the next one
        self.leave_timeout_s = leave_timeout_s()
        self._send_lock = threading.Lock()
        self.send("hello", worker=worker_id, pid=os.getpid())
        threading.Thread(target=self._read, name="ringtrain-elastic-driver", daemon=True).start()

    def send(self, op, **fields):
        try:
            with self._send_lock:
                self.sock.sendall(encode(op, **fields))
        except OSError as error:
            raise ElasticError(f"worker {self.worker_id}: the elastic driver went away (the launcher ended or "
                               f"died): {error}") from None

    def _read(self):
        reader = LineReader()
        while True:
            try:
                data = self.sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                self.closed = True
                self.replies.put({"op": "closed"})
                _abort_current_world("the elastic driver went away")
                return
            for message in reader.feed(data):
                op = message["op"]
                if op == "peer_failed":
                    self.failed_generations.add(message["generation"])
                    if message["generation"] == self.generation:
                        _abort_current_world(message["reason"])
                    if message["generation"] == self.generation and self.in_world:
                        threading.Thread(target=self._watch_leaving, args=(self.asked, message["reason"]),
                                         name="ringtrain-elastic-leave", daemon=True).start()
                elif op == "hosts_updated":
                    self.host_updates.put((message["seq"], message["generation"], message["added"],
                                           message["removed"]))
                else:
                    self.replies.put(message)

    def _watch_leaving(self, asked, reason):
        """Exit (status 1) unless this process asks for the next world within leave_timeout_s of a death in its
        world: its main thread is stuck where the abort cannot reach (see the module doc)."""
        deadline = time.monotonic() + self.leave_timeout_s
        while time.monotonic() < deadline:
            if self.asked != asked or not self.in_world or self.closed:
                return
            time.sleep(0.05)
        main = sys._current_frames().get(threading.main_thread().ident)
        where = "".join(traceback.format_stack(main)) if main is not None else "(no main thread)\n"
        sys.stderr.write(f"ringtrain: worker {self.worker_id} could not leave world {self.generation} within "
                         f"{self.leave_timeout_s:g} s ({LEAVE_TIMEOUT_VARIABLE}) of a death in it ({reason}): "
                         f"it exits so that the others re-form without it. Its main thread:\n{where}")
        sys.stderr.flush()
        os._exit(1)

    def expect(self, op, timeout_s, also=()):
        """The driver's next reply, which must be `op` (or one of `also`)."""
        try:
            message = self.replies.get(timeout=timeout_s)
        except queue.Empty:
            raise ElasticError(f"worker {self.worker_id}: the elastic driver sent no {op!r} within "
                               f"{timeout_s:g} s") from None
        if message["op"] == "closed":
            raise ElasticError(f"worker {self.worker_id}: the elastic driver went away (the launcher ended or "
                               f"died) while this worker waited for its {op!r}")
        if message["op"] != op and message["op"] not in also:
            raise ElasticError(f"worker {self.worker_id}: expected {op!r} from the elastic driver, got {message}")
        return message


def _abort_current_world(reason):
    """End every wait on the current world now; its engines fail on their own threads (state.abandon follows)."""
    abort_all(reason)


def client():
    global _client
    with _client_lock:
        if _client is None:
            _client = DriverClient(os.environ[DRIVER_VARIABLE], os.environ.get(WORKER_VARIABLE, str(os.getpid())))
            _install_exit_on_uncaught_exception()
            atexit.register(_say_exiting, _client)
        return _client


def elastic_world(timeout_s):
    """A new world for this worker, as the driver plans it (blocks until the driver has formed the next world)."""
    from mpi4py import MPI

    from .dynamic import accept_one, grow, merge
    driver = client()
    driver.in_world = False
    while True:
        driver.asked += 1
        driver.send("ready")
        plan = driver.expect("world", timeout_s=None, also=("leave",))
        if plan["op"] == "leave":               # scale-down: this worker's slot left the host list
            sys.stderr.write(f"ringtrain: worker {driver.worker_id} leaves the job: {plan['reason']}\n")
            sys.stderr.flush()
            sys.exit(0)
        # the formation barrier: no MPI call until every planned worker is known to be alive; a worker that dies
        # before it makes the driver abandon the plan, and everyone asks again (see the module doc)
        driver.send("planned", generation=plan["generation"])
        if driver.expect("go", timeout_s=None, also=("abandon",))["op"] == "go":
            break
    rank, size = plan["rank"], plan["size"]
    if rank == 0:
        port = MPI.Open_port()
        driver.send("port", port=port)
        world = MPI.COMM_SELF
        try:
            while world.Get_size() < size:
                world = accept_one(world, port, 0)
        finally:
            MPI.Close_port(port)
    else:
        port = driver.expect("connect", timeout_s)["port"]
        world = merge(MPI.COMM_SELF.Connect(port, root=0), high=True)
        driver.send("joined")
        world = grow(world, size, rank)
    ordered = world.Split(color=0, key=rank)
    # errors on it are returned (raised in Python), not fatal: mpi4py sets this on COMM_SELF and the world
    # inherits it through Accept, Merge and Split (checked); said here so it does not rest on mpi4py's rc
    ordered.Set_errhandler(MPI.ERRORS_RETURN)
    if world != MPI.COMM_SELF:
        world.Free()
    driver.generation = plan["generation"]
    driver.in_world = True
    if driver.generation in driver.failed_generations:     # a member died while the world formed
        raise RankFailureError(f"worker {driver.worker_id}: a worker of world {driver.generation} died while it "
                               f"formed")
    return ordered


def _say_exiting(driver):
    """A normal exit: the connection closing next is no death (the exit status tells the driver the rest)."""
    try:
        driver.send("exiting")
    except OSError:
        pass


def _install_exit_on_uncaught_exception():
    """A worker that dies of an exception must not wait in MPI_Finalize for peers it is still connected to (they
    wait for it): print the traceback and leave at once; the driver tells the others."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        try:
            previous(kind, value, tb)
        except Exception:  # noqa: BLE001 -- whatever happens, leave
            traceback.print_exception(kind, value, tb)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    sys.excepthook = hook
