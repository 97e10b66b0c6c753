"""Process-wide state: init(), shutdown() and the topology queries."""
import atexit
import logging
import signal
import threading
import warnings

from .. import gpu
from . import names, set_registry
from ..config import Config, horovod_warnings
from ..errors import NotInitializedError, RingtrainError

_lock = threading.Lock()
_state = None     # (topology, engine, config, gpu_id) while initialised
_exporter = None  # the metrics endpoint / file (core/metrics.py) while initialised


def init(comm=None, process_sets: "list | None" = None, **config_overrides) -> None:
    """Start ringtrain on `comm` (default MPI.COMM_WORLD): topology, GPU binding, transports, engine thread.
    process_sets: ProcessSets (or lists of world ranks) to register right away, as add_process_set() would
    ("dynamic", Horovod's switch for adding sets later, is accepted: sets can always be added and removed).
    Keyword arguments override RINGTRAIN_* settings (see ringtrain.config.Config). Calling init() twice is a no-op."""
    global _state
    with _lock:
        if _state is not None:
            return
        config = Config.from_env(**config_overrides)
        _setup_logging(config.log_level)
        for message in horovod_warnings():
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        from mpi4py import MPI
        if not MPI.Is_initialized():
            MPI.Init_thread(MPI.THREAD_MULTIPLE)
        if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
            raise RingtrainError("MPI was initialised with a thread level below MPI_THREAD_SERIALIZED; ringtrain's "
                                 "engine thread needs at least SERIALIZED (mpi4py's default is MULTIPLE)")
        from ..engine.engine import Engine
        from ..topology import Topology
        if comm is None:
            from ..world.join import launched_world
            comm = launched_world(MPI.COMM_WORLD, config)     # MPI's world, a joined one, or a LaunchError
        topology = Topology(comm, config.simulate_nodes)
        gpu_id = _bind_gpu(gpu_index(topology.local_rank))
        engine = Engine(topology, config)
        _state = (topology, engine, config, gpu_id)
        names.reset()
    atexit.register(_shutdown_at_exit)
    _install_dump_signal()
    _start_metrics(config, topology)
    set_registry.set_world(topology.rank, topology.size)
    if process_sets == "dynamic":     # Horovod's switch for add/remove after init: always on here
        process_sets = ()
    for process_set in process_sets or ():
        _add_process_set(process_set, topology.world, config)


def _add_process_set(process_set, world, config):
    """init(process_sets=...): as process_sets.add_process_set, agreeing on the ranks with one MPI allgather on
    the world (every rank is in init() together; the collectives sit above this module)."""
    if not isinstance(process_set, set_registry.ProcessSet):
        process_set = set_registry.ProcessSet(process_set)
    if process_set.process_set_id is not None:
        raise ValueError(f"{process_set!r} is already registered")
    ranks = process_set.ranks
    if ranks is None:
        ranks = set_registry._world_ranks_of(process_set.mpi_comm, world)
    set_registry.create(process_set, world.allgather(ranks), world, config)


def gpu_index(local_rank):
    """Which GPU this process binds, before `% device_count`: its slot in an elastic job, else its local rank."""
    from ..world import elastic_worker
    slot = elastic_worker.slot()
    return local_rank if slot is None else slot


def _bind_gpu(local_rank):
    """The GPU of this local rank, or None when there is none (CPU path, silently)."""
    try:
        return gpu.bind(local_rank) if gpu.available() else None
    except Exception:
        logging.getLogger("ringtrain").debug("GPU binding failed; using the CPU path", exc_info=True)
        return None


def shutdown() -> None:
    """Stop the engine once every rank has called shutdown(). Safe to call twice; init() may be called again."""
    global _state
    if _state is None:
        return
    _stop_metrics()
    set_registry.shutdown_all()     # their engines first: each set's members stop it together
    with _lock:
        if _state is None:
            return
        topology, engine, config, _ = _state
        _state = None
    clean = engine.shutdown(timeout=max(config.stall_timeout_s, 10.0))
    if clean and engine.failed is None:
        engine.close()
        topology.free()


def abandon(reason):
    """Leave the current world without any MPI call on it (collective calls would wait for a dead peer forever):
    every engine's waits end with RankFailureError(reason), their threads stop, nothing is freed. init(comm=...)
    may then start ringtrain on a new world. Used by ringtrain.elastic when a peer died; a no-op when not
    initialised."""
    global _state
    from ..errors import RankFailureError
    _stop_metrics()                  # its port is the next world's
    with _lock:
        if _state is None:
            return
        _, engine, _, _ = _state
        _state = None
    error = RankFailureError(reason)
    set_registry.abandon_all(error)
    engine.abandon(error)


def _engines():
    """(process set id, engine) of every engine of this rank, the world's first."""
    state = _state
    world = [] if state is None else [(0, state[1])]
    return world + set_registry.member_engines()


def _start_metrics(config, topology):
    global _exporter
    _stop_metrics()                  # a world left by abandon() (elastic) still serves: the new one takes over
    if not (config.metrics_port or config.metrics_file):
        return
    from . import metrics
    _exporter = metrics.Exporter(_engines, topology.rank, topology.local_rank, config.metrics_port,
                                 config.metrics_file).start()


def _stop_metrics():
    global _exporter
    exporter, _exporter = _exporter, None
    if exporter is not None:
        exporter.stop()


DUMP_SIGNAL = signal.SIGUSR1


def _install_dump_signal():
    """On SIGUSR1 every engine of this process writes its flight recorder (python -m ringtrain.doctor merges the
    files) -- unless the program has a handler of its own for it, or init() runs outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(DUMP_SIGNAL) not in (signal.SIG_DFL, None):
        return
    signal.signal(DUMP_SIGNAL, _dump_on_signal)


def _dump_on_signal(signum, frame):
    # reads the ring buffers only: takes no lock the interrupted code may hold (the compiled calls' entries are
    # drained first only when the progress lock is free)
    for _, engine in _engines():
        try:
            engine.fast.drain(blocking=False)
            engine.observer.dump(f"signal {signal.Signals(signum).name}")
        except Exception:
            logging.getLogger("ringtrain").exception("ringtrain: could not write the flight recorder on a signal")


def _shutdown_at_exit():
    try:
        shutdown()
    except Exception:
        pass


def is_initialized() -> bool:
    """True between init() and shutdown()."""
    return _state is not None


def _get():
    if _state is None:
        raise NotInitializedError("ringtrain is not initialised: call ringtrain.init() first")
    return _state


def engine():
    return _get()[1]


def topology():
    return _get()[0]


def rank() -> int:
    """This process's rank in the world, 0 .. size() - 1."""
    return _get()[0].rank


def size() -> int:
    """The number of ranks in the world."""
    return _get()[0].size


def local_rank() -> int:
    """This process's rank among the ranks of its node (the GPU it is bound to is local_rank % device count)."""
    return _get()[0].local_rank


def local_size() -> int:
    """The number of ranks on this process's node."""
    return _get()[0].local_size


def cross_rank() -> int:
    """The index of this process's node among the nodes (its rank among the ranks with the same local_rank)."""
    return _get()[0].cross_rank


def cross_size() -> int:
    """The number of nodes (the number of ranks with this process's local_rank)."""
    return _get()[0].cross_size


def gpu_device() -> "int | None":
    """The id of the GPU bound at init(), or None on the CPU path."""
    return _get()[3]


def config() -> Config:
    """The settings in force (a ringtrain.config.Config): RINGTRAIN_* environment variables and init() keywords."""
    return _get()[2]


def transport_name(device: str = "cpu") -> str:
    """The name of the transport the engine uses for arrays on `device` ("cpu" or "cuda"), e.g. "shm", "mpi",
    "hierarchical(shm+mpi)", "nccl"."""
    return _get()[1].transport_name(device)


def is_homogeneous() -> bool:
    """True when every node runs the same number of ranks."""
    return _get()[0].homogeneous


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start (or restart into another file) the Chrome-trace timeline at run time, as RINGTRAIN_TIMELINE does at
    init: rank 0 writes file_path (every rank, file.rank<r>.ext, with RINGTRAIN_TIMELINE_ALL_RANKS). mark_cycles
    is accepted for Horovod's signature; the engine has no cycles to mark."""
    from ..timeline import Timeline, timeline_path
    eng = engine()
    path = timeline_path(str(file_path), rank(), config().timeline_all_ranks)
    if path is None:
        return
    previous = eng.timeline
    # the engine reads `timeline` from its own thread: swap in a live one, never None, then close the old one
    eng.timeline = Timeline(path, rank())
    if previous is not None:
        previous.close()


def stop_timeline() -> None:
    """Close the timeline file (valid JSON from then on); later events are dropped until start_timeline()."""
    timeline = engine().timeline
    if timeline is not None:
        timeline.close()     # a closed Timeline ignores further events, so the engine thread may keep calling it


def _setup_logging(level):
    logger = logging.getLogger("ringtrain")
    logger.setLevel(getattr(logging, str(level).upper(), logging.WARNING))
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[ringtrain %(levelname)s] %(message)s"))
        logger.addHandler(handler)
