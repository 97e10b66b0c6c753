"""A survivor that learns of a death one batch before the others, as the test scripts' LATE_RANK.

When a worker dies right after a batch's last collective returned on it, a survivor whose part of that collective
was still waiting (for data, or for its turn on a loaded machine) is woken by the death and fails in that batch; a
survivor whose part had returned fails in the next one. So the survivors roll back from different points: one has
not run that batch's end (its callbacks, its commit) and the other has. fail_with_the_world() makes a rank the
late one for certain: it waits until the death has reached this rank, then raises what the collective would have.
"""
import time

from ringtrain.core import state as core_state


def fail_with_the_world(timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while core_state.engine().failed is None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"no worker's death reached this rank within {timeout_s:g} s")
        time.sleep(0.01)
    raise core_state.engine().failed
