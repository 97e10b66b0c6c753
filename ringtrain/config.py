"""RINGTRAIN_* environment variables and init() keyword overrides, read once at init()."""
import dataclasses
import os

_MB = 1 << 20


@dataclasses.dataclass
class Config:
    transport: str = "auto"            # auto | shm | mpi | mpi_allreduce | nccl | nccl_allreduce | cuda_ipc
    fusion_threshold: int = 32 * _MB   # bytes per fusion bucket
    shared_pool_bytes: int = 256 * _MB  # shm: room per rank in the shared window for empty_shared() arrays
                                        # (address space only: a page costs memory once an array touches it)
    result_window_bytes: int = 128 * _MB  # shm: room per rank in the shared window for out-of-place allreduce
                                          # results of 4-64 MB (two slots of half of it; 0 = none)
    cycle_time_ms: float = 1.0         # longest the engine sleeps before looking at the queue again
    segment_bytes: int = 1 * _MB       # ring pipeline segment
    max_message_elements: int = 2**31 - 1  # MPI counts are int: larger transfers are split
    cache_capacity: int = 1024         # cached collectives (name + metadata) agreed by id; least recently used
                                       # evicted first (Horovod's HOROVOD_CACHE_CAPACITY); 0 = no cache
    stall_warning_s: float = 30.0
    stall_timeout_s: float = 120.0
    gpu_spin_us: float = 200.0         # GPU transports poll their stream this long before sleeping in a sync
    peer_check_s: float = 0.5          # how often blocked waits look whether a peer process died
    timeline: str = ""                 # Chrome-trace file path
    timeline_all_ranks: bool = False
    log_level: str = "WARNING"
    check_every: int = 0               # parameter consistency check period (steps), 0 = off
    hierarchical: str = "auto"         # auto | 1 | 0: intra-node reduce-scatter, inter-node ring, intra allgather
    simulate_nodes: int = 0            # split one machine's ranks into this many pretend nodes (tests, benchmarks)
    jax_lowering: str = "auto"         # auto | ffi | callback: how ringtrain.jax's collectives run inside jit
                                       # (auto: the compiled XLA FFI handler, else JAX's Python host callback)
    elastic: bool = False              # a dead peer ends only this world (ringtrain.elastic forms the next one):
                                       # no forced exit of the process, and the old world is abandoned, not freed
    drive_mpi_progress: bool = False   # every wait and idle engine pass makes an MPI call (one probe), for MPI
                                       # network modules that move data only inside MPI calls; init() turns it on
                                       # in worlds joined from separately started processes (elastic, torchrun)
    # what a job is doing (docs/guides/observability.md)
    straggler_window_s: float = 10.0   # rank 0 judges the ranks' waits over windows of this length
    straggler_share: float = 0.2       # ... and names a rank the others waited for this share of a window or more
    straggler_min_ms: float = 5.0      # ... and at least this long per wait on average (scheduling noise is shorter)
    straggler_log_interval_s: float = 300.0    # at most one such log line per rank per this many seconds
    flight_recorder_size: int = 1024   # the last collectives each rank remembers (rounded up to a power of two);
                                       # 0 = no flight recorder
    flight_recorder_dir: str = ""      # where ranks write their dumps ("": <tmp>/ringtrain-flight-recorder/<job>)
    metrics_port: int = 0              # serve OpenMetrics on this port + local rank (0: no endpoint)
    metrics_file: str = ""             # write OpenMetrics text here every few seconds ("{rank}" in it: per rank)
    native: bool = True                # the express cycle's control plane in compiled code when it builds (a C
                                       # compiler on first use); 0: the Python path (the same results)

    @classmethod
    def from_env(cls, **overrides):
        """Defaults, then Horovod's HOROVOD_* settings that have a ringtrain counterpart (HOROVOD_SETTINGS), then
        RINGTRAIN_* settings (they win over HOROVOD_* ones), then `overrides` (init()'s keyword arguments)."""
        cfg = cls()
        fields = {field.name: field for field in dataclasses.fields(cls)}
        for horovod_name, (name, convert) in HOROVOD_SETTINGS.items():
            raw = os.environ.get(horovod_name)
            if raw is None or raw.strip() == "":
                continue
            try:
                value = convert(raw.strip())
            except ValueError:
                raise ValueError(f"{horovod_name}={raw!r} is not a valid value for ringtrain's {name} "
                                 f"(RINGTRAIN_{name.upper()})") from None
            if value is not None:
                setattr(cfg, name, _parse(fields[name], str(value)))
        for field in dataclasses.fields(cls):
            raw = os.environ.get("RINGTRAIN_" + field.name.upper())
            if raw is not None and raw != "":
                setattr(cfg, field.name, _parse(field, raw))
        for key, value in overrides.items():
            if not hasattr(cfg, key):
                raise TypeError(f"init() got an unknown option {key!r}")
            setattr(cfg, key, value)
        return cfg


def _parse(field, raw):
    kind = field.type if isinstance(field.type, str) else field.type.__name__
    try:
        if kind == "int":
            return int(float(raw))
        if kind == "float":
            return float(raw)
        if kind == "bool":
            return raw.strip().lower() in ("1", "true", "yes", "on")
    except ValueError:
        raise ValueError(f"RINGTRAIN_{field.name.upper()}={raw!r} is not a valid {kind}") from None
    return raw


# ---------------------------------------------------------------- Horovod's settings

def _on(raw):
    return raw.lower() not in ("0", "false", "no", "off", "")


def _positive_or_none(raw):
    """HOROVOD_STALL_SHUTDOWN_TIME_SECONDS: 0 is Horovod's 'never shut down', which has no ringtrain counterpart."""
    value = float(raw)
    return value if value > 0 else None


_HOROVOD_LOG_LEVELS = {"trace": "DEBUG", "debug": "DEBUG", "info": "INFO", "warning": "WARNING", "error": "ERROR",
                       "fatal": "CRITICAL"}


def _log_level(raw):
    if raw.lower() not in _HOROVOD_LOG_LEVELS:
        raise ValueError(raw)
    return _HOROVOD_LOG_LEVELS[raw.lower()]


def _timeline(raw):
    """HOROVOD_TIMELINE=DYNAMIC means 'no file until start_timeline()', which is ringtrain's default anyway."""
    return None if raw.upper() == "DYNAMIC" else raw


# HOROVOD_* name -> (Config field, converter of the raw string; None = leave the field alone). A RINGTRAIN_* value of
# the same field wins; docs/porting/horovod.md has the table.
HOROVOD_SETTINGS = {
    "HOROVOD_FUSION_THRESHOLD": ("fusion_threshold", lambda raw: int(float(raw))),
    "HOROVOD_CYCLE_TIME": ("cycle_time_ms", float),
    "HOROVOD_CACHE_CAPACITY": ("cache_capacity", lambda raw: int(float(raw))),
    "HOROVOD_TIMELINE": ("timeline", _timeline),
    "HOROVOD_STALL_CHECK_TIME_SECONDS": ("stall_warning_s", float),
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": ("stall_timeout_s", _positive_or_none),
    "HOROVOD_HIERARCHICAL_ALLREDUCE": ("hierarchical", lambda raw: "1" if _on(raw) else "0"),
    "HOROVOD_LOG_LEVEL": ("log_level", _log_level),
}

# HOROVOD_* name -> (when it changes something in Horovod: a test of the raw value, what ringtrain does instead)
HOROVOD_NOT_MAPPED = {
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": (
        lambda raw: _positive_or_none(raw) is None,
        "ringtrain always ends a stall with an error on every rank after RINGTRAIN_STALL_TIMEOUT_S seconds "
        "(default 120); 0 ('never') has no counterpart"),
    "HOROVOD_STALL_CHECK_DISABLE": (
        _on, "ringtrain's stall check cannot be turned off: it warns after RINGTRAIN_STALL_WARNING_S and raises "
             "after RINGTRAIN_STALL_TIMEOUT_S; set those higher instead"),
    "HOROVOD_HIERARCHICAL_ALLGATHER": (
        _on, "ringtrain has one hierarchy setting for every collective, RINGTRAIN_HIERARCHICAL (auto: on when the "
             "ranks span several nodes); HOROVOD_HIERARCHICAL_ALLREDUCE maps to it"),
    "HOROVOD_AUTOTUNE": (
        _on, "ringtrain does not autotune; set RINGTRAIN_FUSION_THRESHOLD and RINGTRAIN_CYCLE_TIME_MS yourself "
             "(ringtrain's engine does not wait out a cycle when work is queued, so the cycle time matters less)"),
    "HOROVOD_AUTOTUNE_LOG": (lambda raw: True, "ringtrain does not autotune, so there is no autotune log"),
    "HOROVOD_TIMELINE_MARK_CYCLES": (
        _on, "ringtrain's timeline (RINGTRAIN_TIMELINE) has no cycle markers"),
    "HOROVOD_MPI_THREADS_DISABLE": (
        _on, "ringtrain's engine thread needs MPI_THREAD_MULTIPLE (at least SERIALIZED) and always asks for it"),
    "HOROVOD_CPU_OPERATIONS": (
        lambda raw: raw.lower() != "mpi",
        "ringtrain moves host data over its own transports on MPI (shared memory within a node); there is no Gloo "
        "or oneCCL path (RINGTRAIN_TRANSPORT picks the transport)"),
    "HOROVOD_CONTROLLER": (
        lambda raw: raw.lower() != "mpi", "ringtrain's control plane is always MPI"),
    "HOROVOD_NUM_NCCL_STREAMS": (
        lambda raw: True, "ringtrain's NCCL transport uses one stream per device"),
    "HOROVOD_BATCH_D2D_MEMCOPIES": (
        lambda raw: True, "ringtrain always packs a GPU fusion bucket with one batched-copy kernel"),
    "HOROVOD_THREAD_AFFINITY": (
        lambda raw: True, "ringtrain does not pin its engine thread; pin the process with your launcher instead"),
    "HOROVOD_DISABLE_GROUP_FUSION": (
        _on, "ringtrain fuses a group's tensors with other ready tensors of the same dtype; there is no switch"),
    "HOROVOD_ENABLE_ASYNC_COMPLETION": (
        lambda raw: True, "ringtrain's GPU results are always completed asynchronously (waits synchronise on an event)"),
    "HOROVOD_ADASUM_MPI_CHUNK_SIZE": (
        lambda raw: True, "ringtrain's Adasum moves whole halves through its own transports, not MPI chunks"),
    "HOROVOD_DYNAMIC_PROCESS_SETS": (
        lambda raw: False, ""),          # sets can always be added and removed after init(): nothing to say
    "HOROVOD_ENABLE_XLA_OPS": (
        _on, "ringtrain's TensorFlow collectives are host ops that XLA does not compile (see the TensorFlow guide)"),
    "HOROVOD_GLOO_IFACE": (lambda raw: True, "ringtrain has no Gloo path; MPI picks the network interface"),
    "HOROVOD_CCL_CACHE": (lambda raw: True, "ringtrain has no oneCCL path"),
}


def horovod_warnings(environ=None):
    """One message per HOROVOD_* setting in the environment that ringtrain does not follow, saying what it does
    instead (init() warns with each)."""
    environ = os.environ if environ is None else environ
    messages = []
    for name, (applies, instead) in HOROVOD_NOT_MAPPED.items():
        raw = environ.get(name)
        if raw is None or raw.strip() == "":
            continue
        try:
            relevant = applies(raw.strip())
        except ValueError:
            relevant = True
        if relevant:
            messages.append(f"{name}={raw} is ignored: {instead}")
    return messages
