"""What a running job is doing, for its user: straggler scores, the flight recorder on demand (a call or a
signal), and the metrics endpoint (core/metrics.py). See docs/guides/observability.md."""
from . import routing, set_registry, state


def straggler_report(process_set=None) -> dict:
    """How long the ranks (of `process_set`) waited for each other in agreement cycles, from this rank's view of
    every rank's totals: {"ranks": [{"rank", "host", "waited_s" (the others' waits for it, summed), "waits",
    "waited_by_this_rank_s", and from the last judged window (RINGTRAIN_STRAGGLER_WINDOW_S) "window_share",
    "window_mean_ms", "straggler"}], "window_s", "stragglers": [ranks judged stragglers in that window]}.
    Empty "ranks" where no scores are kept (one rank, or the coordinator protocol beyond 64 ranks across nodes)."""
    stragglers = routing.route(process_set).engine.observer.stragglers
    if stragglers is None:
        return {"ranks": [], "window_s": None, "stragglers": []}
    return stragglers.report()


def dump_flight_recorder(directory: "str | None" = None, reason: str = "requested") -> "str | None":
    """Write this rank's flight recorder -- its last RINGTRAIN_FLIGHT_RECORDER_SIZE collectives -- to
    `directory` (default RINGTRAIN_FLIGHT_RECORDER_DIR, else one directory per job under the system's temporary
    directory), the engines of this rank's process sets beside it. Returns the world engine's file, or None when
    the recorder is off. Merge every rank's files with `python -m ringtrain.doctor DIRECTORY`."""
    state.engine().fast.drain()
    path = state.engine().observer.dump(reason, directory)
    for _, engine in set_registry.member_engines():
        engine.fast.drain()
        engine.observer.dump(reason, directory)
    return path


def flight_recorder_dir() -> str:
    """Where this job's flight recorder files go (RINGTRAIN_FLIGHT_RECORDER_DIR or the job's default)."""
    return state.engine().recorder.directory
