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

    @classmethod
    def from_env(cls, **overrides):
        cfg = cls()
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
