"""hvd.elastic.run: run a training function, and when the world changes, re-form it and go on.

    @hvd.elastic.run                    # lossless (the default)
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...                # steps
    train(state)

    @hvd.elastic.run(rollback=True)     # Horovod's: state.commit() every few batches is what a failure goes back to

On HorovodInternalError (a collective failed: a worker died) the dead world is left without another MPI call on it,
the survivors and any new workers form the next one, and the function is called again after sync(): in lossless
mode every rank takes the live state of the survivor that completed the most steps (ringtrain/elastic/lossless.py),
so only the step in flight is lost; in roll-back mode the state is first rolled back to its last commit and everyone
takes rank 0's. On HostsUpdatedInterrupt (workers were added or removed) the world is re-formed without a roll-back.
Outside an elastic job (`ringtrain-run` without elastic flags, plain mpiexec) the function simply runs once after a
sync.
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


def run(func=None, *, rollback=False):
    """Decorate a training function `func(state, ...)`; rollback=True restores Horovod's roll-back to the last
    commit (see the module doc)."""
    if func is None:
        return functools.partial(run, rollback=rollback)

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        state.rollback = rollback
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
                result = func(state, *args, **kwargs)
                state.drop_held()       # a decision of the last step must not raise outside this function
                return result
            except ElasticError:
                raise
            except HorovodInternalError as error:
                last_recovery.clear()
                last_recovery["error"] = time.time()
                if rollback:
                    state.restore()
                failed, skip_sync = error, False
            except HostsUpdatedInterrupt as interrupt:
                failed, skip_sync = False, interrupt.skip_sync
    return wrapper


def _reform(error):
    """Leave the current world without another MPI call on it (abandon: nothing of it is freed), and start ringtrain
    on the next one the driver forms.

    Not a clean shutdown, even when every rank got the same interrupt: freeing the world's agreement window is
    collective, and on MPICH's ofi module a rank that has left it makes no more MPI progress (it waits for the
    driver), so a peer still inside MPI_Win_free waits forever -- measured here, one worker of three, with and
    without an earlier abandoned world. What an abandoned world holds (its window, communicator) stays allocated."""
    config = core_state.config() if core_state.is_initialized() else None
    if error is False:
        core_state.abandon("workers were added or removed; re-forming the world")
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
