"""The worker side of an elastic job: its connection to the driver, and forming each new world.

    comm = elastic_world(timeout_s)       # in init(), when the driver's variable is set

One connection per process, kept across worlds. A reader thread takes the driver's notifications as they come:
`peer_failed` ends every wait of the current world at once (watchdog.abort_all: the engines fail on their own
threads, so the training thread sees RankFailureError -- hvd.elastic.run rolls back and re-forms); `hosts_updated` is
answered at once with the steps completed (elastic_boundary.py: the driver picks the step the world stops at) and
queued for the next State.check_host_updates(); `stop_at` is that step. Replies the rendezvous waits for go to a
queue.

Forming a world of n (the driver's plan, ranks in the order it chose): rank 0 opens an MPI port and tells the driver;
the driver tells one joiner at a time to Connect (MPICH crashed here with several Connects pending at once), and
each Accept + Merge grows the world by one with every member taking part (launchers/dynamic.py). A final Split
orders it by the planned rank. Survivors of the last world keep their process and their memory: only the
communicator is new.

Before any MPI call, a barrier over the driver's connections: each planned worker answers the plan ("planned") and
waits for "go", which the driver sends once every one of them answered; if one dies before that, the driver sends
"abandon" instead and every worker asks again ("ready"), so a death there costs a re-plan, not the job.
After "go" the MPI calls (Open_port, Accept, Connect, Merge, Split) run on a helper thread, the Accepts and Connects
with a deadline (RINGTRAIN_ELASTIC_CONNECT_TIMEOUT_S, MPI's "timeout" info key). A member that dies then (or that
MPICH's ofi module aborts inside Accept) makes the driver abandon the plan: the members whose MPI call returns (a
Connect to a dead port fails at once, an Accept whose joiner never comes times out, a joiner not yet told to
connect never entered MPI) ask again; one still inside MPI a connect timeout (+ 5 s) later cannot leave it, prints
so and exits with status 1 -- one more death, and the others re-form without it. (A joiner whose Connect is under
way when rank 0 dies is such a one: with libfabric's tcp provider that Connect outlives its timeout.) A member whose own call failed
(a timeout with everyone alive) tells the driver ("form_failed"), which abandons the plan the same way.

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
from .elastic_boundary import StepBoundary
from .elastic_protocol import (CONNECT_TIMEOUT_VARIABLE, DRIVER_VARIABLE, LEAVE_TIMEOUT_VARIABLE, SLOT_VARIABLE,
                               WORKER_VARIABLE, LineReader, connect_timeout_s, encode, leave_timeout_s)

_client = None
STALE_AFTER_ABANDON = ("go", "connect", "abandon")
STUCK_GRACE_S = 5.0             # after a connect timeout, for a formation call to return once its world is abandoned
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
        self.abandoned = set()                  # worlds whose formation the driver abandoned
        self.closed = False
        self.asked = 0                          # how many times this process asked for a world ("ready")
        self.in_world = False                   # between a world's formation and asking for the next one
        self.leave_timeout_s = leave_timeout_s()
        self.connect_timeout_s = connect_timeout_s()
        self._send_lock = threading.Lock()
        # the driver answers a step report within milliseconds; the timeout only turns a driver bug into an error
        self.boundary = StepBoundary(self._send_quietly, worker_id, max(self.leave_timeout_s, 30.0))
        self.send("hello", worker=worker_id, pid=os.getpid())
        threading.Thread(target=self._read, name="ringtrain-elastic-driver", daemon=True).start()

    def send(self, op, **fields):
        try:
            with self._send_lock:
                self.sock.sendall(encode(op, **fields))
        except OSError as error:
            raise ElasticError(f"worker {self.worker_id}: the elastic driver went away (the launcher ended or "
                               f"died): {error}") from None

    def _send_quietly(self, op, **fields):
        """From the reader thread: a driver gone is seen by its next recv."""
        try:
            self.send(op, **fields)
        except ElasticError:
            pass

    def _read(self):
        reader = LineReader()
        while True:
            try:
                data = self.sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                self.closed = True
                self.boundary.broken(None)
                self.replies.put({"op": "closed"})
                _abort_current_world("the elastic driver went away")
                return
            for message in reader.feed(data):
                op = message["op"]
                if op == "abandon":
                    self.abandoned.add(message["generation"])
                if op == "abandon" and message["generation"] == self.generation and self.in_world:
                    op = "peer_failed"          # the driver gave up on a world this process thinks formed
                    message = dict(message, reason=f"world {self.generation} was abandoned while it formed")
                if op == "peer_failed":
                    self.failed_generations.add(message["generation"])
                    self.boundary.broken(message["generation"])
                    if message["generation"] == self.generation:
                        _abort_current_world(message["reason"])
                    if message["generation"] == self.generation and self.in_world:
                        threading.Thread(target=self._watch_leaving, args=(self.asked, message["reason"]),
                                         name="ringtrain-elastic-leave", daemon=True).start()
                elif op == "hosts_updated":
                    self.host_updates.put((message["seq"], message["generation"], message["added"],
                                           message["removed"]))
                    self.boundary.heard(message["seq"], message["generation"])
                elif op == "stop_at":
                    self.boundary.answer(message["generation"], message["steps"], message["seq"], message["added"],
                                         message["removed"])
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

    def expect(self, op, timeout_s, also=(), generation=None):
        """The driver's next reply, which must be `op` (or one of `also`). With `generation`, replies about other
        worlds are skipped; without, the leftovers of abandoned formations ("go", "connect", "abandon")."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                message = self.replies.get(timeout=None if deadline is None else max(0, deadline - time.monotonic()))
            except queue.Empty:
                raise ElasticError(f"worker {self.worker_id}: the elastic driver sent no {op!r} within "
                                   f"{timeout_s:g} s") from None
            if message["op"] == "closed":
                self.replies.put(message)       # for whoever waits next
                raise ElasticError(f"worker {self.worker_id}: the elastic driver went away (the launcher ended or "
                                   f"died) while this worker waited for its {op!r}")
            if generation is not None and message.get("generation", generation) != generation:
                continue
            if generation is None and message["op"] in STALE_AFTER_ABANDON:
                continue
            if message["op"] != op and message["op"] not in also:
                raise ElasticError(f"worker {self.worker_id}: expected {op!r} from the elastic driver, got "
                                   f"{message}")
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
        generation = plan["generation"]
        driver.send("planned", generation=generation)
        if driver.expect("go", timeout_s=None, also=("abandon",), generation=generation)["op"] == "abandon":
            continue
        ordered = _form_or_give_up(driver, plan, timeout_s)
        if ordered is not None:
            break
    driver.generation = generation
    driver.boundary.new_world(generation)
    driver.in_world = True
    if generation in driver.failed_generations:     # a member died just as the world formed
        raise RankFailureError(f"worker {driver.worker_id}: a worker of world {generation} died while it formed")
    return ordered


class _Abandoned(Exception):
    """The driver abandoned the world being formed before this worker was told to connect."""


def _form_or_give_up(driver, plan, timeout_s):
    """The world `plan` formed on a helper thread; None when the driver abandoned it (ask again). A process whose
    formation call is still inside MPI a connect timeout (+ STUCK_GRACE_S) after the driver gave up on the world
    exits with status 1 (see the module doc)."""
    generation = plan["generation"]
    done = {}

    def form():
        try:
            done["world"] = _form(driver, plan, timeout_s)
        except BaseException as error:  # noqa: BLE001 -- handed to the waiting thread
            done["error"] = error

    helper = threading.Thread(target=form, name="ringtrain-elastic-form", daemon=True)
    helper.start()
    given_up_at = None
    told = False
    limit = driver.connect_timeout_s + STUCK_GRACE_S
    # every Accept/Connect of the formation ends within the connect timeout; a call that cannot even start (MPI
    # held by a thread that hangs in a send to a dead worker: libfabric's tcp provider never fails that send)
    deadline = time.monotonic() + plan["size"] * driver.connect_timeout_s + STUCK_GRACE_S
    while True:
        helper.join(0.02)
        if not helper.is_alive():
            error = done.get("error")
            if error is None:
                return None if generation in driver.abandoned else done["world"]
            if isinstance(error, (ElasticError, KeyboardInterrupt, SystemExit)):
                raise error
            if isinstance(error, _Abandoned) or _given_up(driver, generation):
                return None     # (what the failed formation made is left alone: nothing of it is freed)
            if not told:        # an MPI call failed here (a timeout, a dead peer's port): the driver decides
                driver.send("form_failed", generation=generation, reason=_one_line(error))
                told = True
            continue
        if given_up_at is None and _given_up(driver, generation):
            given_up_at = time.monotonic()
        if given_up_at is not None and time.monotonic() - given_up_at > limit:
            _exit_stuck(driver, generation, helper, f"{limit:g} s after the driver gave up on it "
                                                    f"({CONNECT_TIMEOUT_VARIABLE} + {STUCK_GRACE_S:g} s)")
        if time.monotonic() > deadline:
            _exit_stuck(driver, generation, helper, f"past its deadline ({plan['size']} x "
                                                    f"{CONNECT_TIMEOUT_VARIABLE} + {STUCK_GRACE_S:g} s)")


def _given_up(driver, generation):
    return generation in driver.abandoned or generation in driver.failed_generations or driver.closed


def _one_line(error):
    return " ".join(str(error).split())[:300]


def _exit_stuck(driver, generation, helper, when):
    frame = sys._current_frames().get(helper.ident)
    where = "".join(traceback.format_stack(frame)) if frame is not None else "(gone)\n"
    sys.stderr.write(f"ringtrain: worker {driver.worker_id} is still inside MPI forming world {generation} {when}: "
                     f"it exits so that the others re-form without it. Where:\n{where}")
    sys.stderr.flush()
    os._exit(1)


def _form(driver, plan, timeout_s):
    """The MPI side of forming world `plan` (the helper thread): rank 0 opens a port and Accepts each joiner in
    turn, joiners Connect when the driver says, everyone Merges; then a Split orders it by the planned rank."""
    from mpi4py import MPI

    from .dynamic import grow, merge
    rank, size, generation = plan["rank"], plan["size"], plan["generation"]
    info = MPI.Info.Create()
    info.Set("timeout", str(max(1, int(round(driver.connect_timeout_s)))))
    if rank == 0:
        port = MPI.Open_port()
        driver.send("port", port=port, generation=generation)
        world = MPI.COMM_SELF
        try:
            while world.Get_size() < size:
                world = _accept_one(world, port, info)
        finally:
            MPI.Close_port(port)
    else:
        message = driver.expect("connect", timeout_s, also=("abandon",), generation=generation)
        if message["op"] == "abandon":
            raise _Abandoned()
        world = merge(_connect(driver, generation, message["port"], info), high=True)
        driver.send("joined", generation=generation)
        world = grow(world, size, rank, info)
    ordered = world.Split(color=0, key=rank)
    # errors on it are returned (raised in Python), not fatal: mpi4py sets this on COMM_SELF and the world
    # inherits it through Accept, Merge and Split (checked); said here so it does not rest on mpi4py's rc
    ordered.Set_errhandler(MPI.ERRORS_RETURN)
    if world != MPI.COMM_SELF:
        world.Free()
    return ordered


def _accept_one(world, port, info):
    from .dynamic import accept_one
    return accept_one(world, port, 0, info)


def _connect(driver, generation, port, info):
    """Connect to the forming world's port, unless the driver gave up on that world meanwhile: with libfabric's tcp
    provider a Connect to the port of a process that died hangs past its timeout."""
    from mpi4py import MPI
    if _given_up(driver, generation):
        raise _Abandoned()
    return MPI.COMM_SELF.Connect(port, info, root=0)


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
