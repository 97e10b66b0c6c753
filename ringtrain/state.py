"""Process-wide state: init(), shutdown() and the topology queries."""
import atexit
import logging
import threading

from . import gpu, names
from .config import Config
from .errors import NotInitializedError, RingtrainError

_lock = threading.Lock()
_state = None     # (topology, engine, config, gpu_id) while initialised


def init(comm=None, **config_overrides):
    """Start ringtrain on `comm` (default MPI.COMM_WORLD): topology, GPU binding, transports, engine thread.
    Keyword arguments override RINGTRAIN_* settings (see ringtrain.config.Config). Calling init() twice is a no-op."""
    global _state
    with _lock:
        if _state is not None:
            return
        config = Config.from_env(**config_overrides)
        _setup_logging(config.log_level)
        from mpi4py import MPI
        if not MPI.Is_initialized():
            MPI.Init_thread(MPI.THREAD_MULTIPLE)
        if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
            raise RingtrainError("MPI was initialised with a thread level below MPI_THREAD_SERIALIZED; ringtrain's "
                                 "engine thread needs at least SERIALIZED (mpi4py's default is MULTIPLE)")
        from .engine import Engine
        from .topology import Topology
        if comm is None:
            from .launchers.join import launched_world
            comm = launched_world(MPI.COMM_WORLD, config)     # MPI's world, a joined one, or a LaunchError
        topology = Topology(comm, config.simulate_nodes)
        gpu_id = _bind_gpu(topology.local_rank)
        engine = Engine(topology, config)
        _state = (topology, engine, config, gpu_id)
        names.reset()
    atexit.register(_shutdown_at_exit)


def _bind_gpu(local_rank):
    """The GPU of this local rank, or None when there is none (CPU path, silently)."""
    try:
        return gpu.bind(local_rank) if gpu.available() else None
    except Exception:
        logging.getLogger("ringtrain").debug("GPU binding failed; using the CPU path", exc_info=True)
        return None


def shutdown():
    """Stop the engine once every rank has called shutdown(). Safe to call twice; init() may be called again."""
    global _state
    with _lock:
        if _state is None:
            return
        topology, engine, config, _ = _state
        _state = None
    clean = engine.shutdown(timeout=max(config.stall_timeout_s, 10.0))
    if clean and engine.failed is None:
        engine.close()
        topology.free()


def _shutdown_at_exit():
    try:
        shutdown()
    except Exception:
        pass


def is_initialized():
    return _state is not None


def _get():
    if _state is None:
        raise NotInitializedError("ringtrain is not initialised: call ringtrain.init() first")
    return _state


def engine():
    return _get()[1]


def rank():
    return _get()[0].rank


def size():
    return _get()[0].size


def local_rank():
    return _get()[0].local_rank


def local_size():
    return _get()[0].local_size


def cross_rank():
    return _get()[0].cross_rank


def cross_size():
    return _get()[0].cross_size


def gpu_device():
    """The id of the GPU bound at init(), or None on the CPU path."""
    return _get()[3]


def config():
    return _get()[2]


def transport_name(device="cpu"):
    return _get()[1].transport_name(device)


def _setup_logging(level):
    logger = logging.getLogger("ringtrain")
    logger.setLevel(getattr(logging, str(level).upper(), logging.WARNING))
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[ringtrain %(levelname)s] %(message)s"))
        logger.addHandler(handler)
