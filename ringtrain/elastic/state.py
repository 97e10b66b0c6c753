"""Elastic state, as Horovod's: what a job rolls back to when a worker dies, and hands to workers that join.

    state = ObjectState(epoch=0, batch=0)      # any picklable attributes
    state.commit()        # save a copy, then check_host_updates(): a collective, so every rank agrees
    state.restore()       # back to the last commit (after HorovodInternalError)
    state.sync()          # every rank takes rank 0's state (after the world changed), which is then committed

commit() is save() + check_host_updates(). check_host_updates() allgathers what each rank has heard from the driver
(hosts added or removed since this world formed), so every rank raises HostsUpdatedInterrupt at the same commit.
"""
import copy

from ..core import collectives
from ..core import state as core_state
from ..world import elastic_worker as worker
from ..errors import HostsUpdatedInterrupt


class State:
    """The base: commit/restore/sync/check_host_updates/register_reset_callbacks. Subclasses implement save(),
    restore(), sync() and (optionally) reset(), which runs when the world changed, before the callbacks."""

    def __init__(self):
        self._reset_callbacks = []
        self._seen_update = None        # the driver's last update sequence number this state acted on

    def register_reset_callbacks(self, callbacks):
        """Functions called with no argument after every change of the world (e.g. to scale the learning rate by
        the new size), after this state's own reset()."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self):
        self.save()
        self.check_host_updates()

    def check_host_updates(self):
        """Raise HostsUpdatedInterrupt on every rank alike when the driver reported workers added or removed since
        this world formed. Collective (an allgather) in an elastic job; a no-op otherwise."""
        if not worker.enabled():
            return
        driver = worker.client()
        seq, added, removed = -1, False, False
        while not driver.host_updates.empty():
            update_seq, generation, update_added, update_removed = driver.host_updates.get_nowait()
            if generation == driver.generation:      # news about an older world is already in this one
                seq = max(seq, update_seq)
                added, removed = added or update_added, removed or update_removed
        heard = collectives.allgather_object((seq, added, removed))
        newest = max(s for s, _, _ in heard)
        if newest < 0 or newest == self._seen_update:
            return
        self._seen_update = newest
        added = any(a for s, a, _ in heard if s >= 0)
        removed = any(r for s, _, r in heard if s >= 0)
        raise HostsUpdatedInterrupt(skip_sync=removed and not added)

    def save(self):
        raise NotImplementedError

    def restore(self):
        raise NotImplementedError

    def sync(self):
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

    def sync(self):
        if self._saved_state and core_state.is_initialized():
            self._saved_state = collectives.broadcast_object(self._saved_state, root_rank=0)
            self._set_attrs()

    def _set_attrs(self):
        for name, value in self._saved_state.items():
            setattr(self, name, copy.deepcopy(value))
