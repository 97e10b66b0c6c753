"""hvd.elastic.run: run a training function, and when the world changes, re-form it and go on.

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...                # steps; state.commit() every few batches
    train(state)

On HorovodInternalError (a collective failed: a worker died) the state is rolled back to its last commit, the dead
world is left without another MPI call on it, the survivors and any new workers form the next one, everyone takes
rank 0's state (sync) and the function is called again. On HostsUpdatedInterrupt (workers were added) the world is
re-formed without a roll-back. Outside an elastic job (`ringtrain-run` without elastic flags, plain mpiexec) the
function simply runs once after a sync.
"""
import functools
import time

from ..core import metrics
from ..core import state as core_state
from ..world import elastic_worker as worker
from ..errors import ElasticError, HorovodInternalError, HostsUpdatedInterrupt


# wall-clock times (time.time()) of the last recovery, for benchmarks/elastic_recovery.py: "error" when the
# collective failed here, "reformed" once the next world is up (and the reset callbacks ran), "synced" after sync()
last_recovery = {}


def run(func):
    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        if not worker.enabled():
            state.sync()
            return func(state, *args, **kwargs)
        failed = None
        skip_sync = False
        while True:
            try:
                if failed is not None:
                    _reform(failed)
                    state.on_reset()
                    last_recovery["reformed"] = time.time()
                    metrics.note_elastic_reset(last_recovery["reformed"] - last_recovery.get("error",
                                                                                             last_recovery["reformed"]))
                if not skip_sync:
                    state.sync()
                last_recovery["synced"] = time.time()
                return func(state, *args, **kwargs)
            except ElasticError:
                raise
            except HorovodInternalError as error:
                last_recovery.clear()
                last_recovery["error"] = time.time()
                state.restore()
                failed, skip_sync = error, False
            except HostsUpdatedInterrupt as interrupt:
                failed, skip_sync = False, interrupt.skip_sync
    return wrapper


def _reform(error):
    """Leave the current world -- cleanly when it is healthy (every rank got the same interrupt), else abandon it --
    and start ringtrain on the next one the driver forms."""
    config = core_state.config() if core_state.is_initialized() else None
    if error is False:
        try:
            core_state.shutdown()
        except HorovodInternalError as shutdown_error:
            core_state.abandon(f"leaving the world after {shutdown_error}")
    else:
        core_state.abandon(f"a collective failed ({error}); re-forming the world")
    overrides = {} if config is None else _overrides(config)
    core_state.init(**overrides)


def _overrides(config):
    """The settings the user passed to init(), to start the next world with them too."""
    import dataclasses

    from ..config import Config
    from_env = Config.from_env()
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
            if getattr(config, f.name) != getattr(from_env, f.name)}
