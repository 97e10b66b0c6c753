"""Lossless recovery, ringtrain's default: after a failure every survivor goes on from the furthest step any of them
completed, so a failure costs at most the step in flight, with no commit() and nothing copied per step.

Why it works: a step's optimizer update runs only after its gradient collectives completed, and a collective
completes on a rank only when every rank contributed. When a worker dies in step k, each survivor holds either
the state after step k-1 (its step k failed) or after step k (its collectives completed before the death), never a
mix; what follows an update up to the next collective (recording the step's samples, counters) is local and runs
alike on every rank. So once the next world has formed, the survivors compare how many steps each completed
(`source_rank`, one allgather), and everyone takes the state of the lowest rank that completed the most; the
sampler's record travels with it, so the samples of the step that did not complete anywhere are dealt again.

HostCheck: stopping, at a step boundary, for workers the driver reported added or removed. No collective per step:
the driver picks the step (world/elastic_boundary.py: each rank reports how far it got when it hears the news, the
driver answers "after step max + 1"), and after that step every rank holds HostsUpdatedInterrupt for the next
boundary (where a step begins, or a commit), on every rank alike. A collective error met after a step's update is
held for that boundary too, so a step that completed is never reported as failed.
"""
from ..core import collectives
from ..core import state as core_state
from ..errors import ElasticError, HostsUpdatedInterrupt
from ..world import elastic_worker as worker

PROGRESS_NAME = "ringtrain.elastic.progress"


def source_rank(progress):
    """(root, everyone's progress): the lowest rank whose progress (steps completed; -1 for a state a broken sync
    left half overwritten) is the greatest. Collective. Raises ElasticError on every rank when no rank holds a
    whole state."""
    everyone = collectives.allgather_object(int(progress), name=PROGRESS_NAME)
    furthest = max(everyone)
    if furthest < 0:
        raise ElasticError(f"no worker holds a whole training state (progress by rank: {everyone}): the workers "
                           f"that held it died while handing it to the others")
    return everyone.index(furthest), everyone


def heard_updates():
    """(seq, added, removed): what this worker's driver connection queued about the current world since the last
    call (seq -1: nothing)."""
    driver = worker.client()
    seq, added, removed = -1, False, False
    while not driver.host_updates.empty():
        update_seq, generation, update_added, update_removed = driver.host_updates.get_nowait()
        if generation == driver.generation:      # news about an older world is already in this one
            seq = max(seq, update_seq)
            added, removed = added or update_added, removed or update_removed
    return seq, int(added), int(removed)


class HostCheck:
    """The step-boundary check of one training state (see the module doc). step_done() after each optimizer step,
    boundary() where a step begins; reset() when the world changed."""

    def __init__(self):
        self.seen = -1                  # the newest update sequence number acted on
        self._held = None               # what boundary() raises next

    def reset(self):
        self._held = None

    def step_done(self):
        """After an optimizer step: count it for the driver's choice of boundary (no collective). Never raises a
        collective error (the step is done; its record must follow it): what the driver decided waits for
        boundary()."""
        if not worker.enabled() or not core_state.is_initialized():
            return
        decision = worker.client().boundary.step_done()
        if decision is not None and self._held is None:
            self.decide(decision)

    def hold(self, error):
        if self._held is None:
            self._held = error

    def boundary(self):
        """Where a step begins (or at a commit): raise what the last check decided, on every rank alike."""
        if self._held is not None:
            held, self._held = self._held, None
            raise held

    def decide(self, heard):
        """heard: every rank's (seq, added, removed) merged (Max): hold HostsUpdatedInterrupt when it is news."""
        seq, added, removed = (int(v) for v in heard)
        if seq < 0 or seq <= self.seen:
            return
        self.seen = seq
        self._held = HostsUpdatedInterrupt(skip_sync=bool(removed) and not added)
