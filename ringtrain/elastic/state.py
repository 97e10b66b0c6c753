"""Elastic state: what every worker of a new world takes from one of them, and (in Horovod's roll-back mode) what a
job rolls back to when a worker dies.

    state = ObjectState(epoch=0, batch=0)      # any picklable attributes
    state.sync()          # after the world changed: every rank takes the source rank's state
    state.commit()        # a point where the world checks for workers added or removed (and, in roll-back mode,
                          # saves a copy first)
    state.restore()       # roll-back mode: back to the last commit (after HorovodInternalError)

Two modes, chosen by hvd.elastic.run. Lossless (the default, ringtrain/elastic/lossless.py): nothing is restored;
sync() takes the live state of the lowest rank that completed the most steps (`progress()`), so a failure costs at
most the step in flight, and commit() copies nothing. Roll-back (`run(..., rollback=True)`, Horovod's): restore()
goes back to the last commit and sync() takes rank 0's committed state.

commit() in roll-back mode is save() + check_host_updates(); check_host_updates() allgathers what each rank has
heard from the driver (hosts added or removed since this world formed), so every rank raises HostsUpdatedInterrupt at
the same commit. In lossless mode the states of the bindings also check at step boundaries (lossless.HostCheck).
"""
import copy

from ..core import collectives
from ..core import state as core_state
from ..world import elastic_worker as worker
from .lossless import HostCheck, heard_updates, source_rank


class State:
    """The base: commit/restore/sync/check_host_updates/register_reset_callbacks. Subclasses implement save(),
    restore(), sync() and (optionally) reset(), which runs when the world changed, before the callbacks."""

    def __init__(self):
        self._reset_callbacks = []
        self.rollback = False           # Horovod's roll-back mode (set by hvd.elastic.run)
        self._host_check = HostCheck()
        self._handing_over = False      # inside sync() as a receiver: this rank's state is half overwritten

    def register_reset_callbacks(self, callbacks):
        """Functions called with no argument after every change of the world (e.g. to scale the learning rate by
        the new size), after this state's own reset()."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        self._host_check.reset()
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self):
        if self.rollback:
            self.save()
        self.check_host_updates()

    def check_host_updates(self):
        """Raise HostsUpdatedInterrupt on every rank alike when the driver reported workers added or removed since
        this world formed. Collective (an allgather) in an elastic job; a no-op otherwise."""
        if not worker.enabled():
            return
        self._host_check.boundary()
        heard = collectives.allgather_object(heard_updates())
        self._host_check.decide([max(column) for column in zip(*heard)])
        self._host_check.boundary()

    def progress(self):
        """How far this rank's state got: the optimizer steps it completed (0 where a state does not count them);
        -1 while sync() is overwriting it (a sync that breaks leaves it unusable as a source)."""
        return -1 if self._handing_over else self.steps_completed()

    def steps_completed(self):
        return 0

    def sync(self):
        """Every rank takes the source rank's state: in lossless mode the lowest rank that completed the most steps
        (its live state), in roll-back mode rank 0 (its last commit, restored)."""
        if not core_state.is_initialized():
            return
        if self.rollback:
            self.sync_from(0)
            return
        root, everyone = source_rank(self.progress())
        self._handing_over = everyone[core_state.rank()] < everyone[root]
        self.sync_from(root)
        self._handing_over = False

    def step_done(self):
        """Call after each optimizer step (the bindings' states do): the step-boundary host check."""
        if not self.rollback:
            self._host_check.step_done()

    def hold(self, error):
        """Raise `error` at the next step boundary instead of now (a step that completed here met it after its
        update)."""
        self._host_check.hold(error)

    def drop_held(self):
        """Forget what the step-boundary check holds (training ended before the next boundary)."""
        self._host_check.reset()

    def step_begins(self):
        """Call where a step begins (the bindings' states do): raises what the step-boundary check decided."""
        self._host_check.boundary()

    def save(self):
        raise NotImplementedError

    def restore(self):
        raise NotImplementedError

    def sync_from(self, root):
        raise NotImplementedError

    def reset(self):
        pass


class ObjectState(State):
    """State held in plain attributes: ObjectState(epoch=0, batch=0) makes state.epoch and state.batch. Each
    commit keeps a deep copy, so later in-place changes do not leak into it."""

    def __init__(self, **kwargs):
        self._saved_state = copy.deepcopy(kwargs)
        self._set_attrs()
        super().__init__()

    def save(self):
        self._saved_state = {name: copy.deepcopy(getattr(self, name)) for name in self._saved_state}

    def restore(self):
        self._set_attrs()

    def sync_from(self, root):
        """The attributes of `root`: its committed ones in roll-back mode, its live ones in lossless mode."""
        if not self._saved_state:
            return
        if self.rollback:
            self._saved_state = collectives.broadcast_object(self._saved_state, root_rank=root)
            self._set_attrs()
            return
        live = {name: getattr(self, name) for name in self._saved_state}
        for name, value in collectives.broadcast_object(live, root_rank=root).items():
            setattr(self, name, value)

    def _set_attrs(self):
        for name, value in self._saved_state.items():
            setattr(self, name, copy.deepcopy(value))
