"""The agreement of a communicator of one rank (a one-process world, or a process set of one rank).

Nothing needs agreeing at one rank, yet the Coordinator's protocol (coordinator_agreement.CoordinatorAgreement)
would send every call through a pass: queue, plan, fusion, executor -- a few hundred microseconds for what is a
copy. So a one-rank communicator (agreement.make_agreement gives it this agreement) keeps the Coordinator for the
general path (async requests, joins, timelines, every other collective) and adds an express path that needs no
cycle: express() answers at once with the Collective of this array alone, and the executor computes it exactly as
the general path does at one rank (the input times the op's scales, out of place or in place).
"""
from .coordinator_agreement import CoordinatorAgreement
from .model import Collective

CAPACITY = 4096     # Collectives kept per (name, Meta) or per plan; past this the table starts again from empty


class SoloAgreement(CoordinatorAgreement):
    """CoordinatorAgreement plus a cycle-free express path (see the module docstring)."""

    def __init__(self, control, config, watchdog, cache_capacity):
        super().__init__(control, config, watchdog, cache_capacity)
        self._actions = {}

    def express(self, name, meta, array, out, make_request, plan=None, resumed=None):
        """The Collective of this one allreduce, for the executor to run now. Never a request: with no peer there
        is nothing to wait for. None only for an empty array (the general path's business, as at N ranks)."""
        if not array.nbytes:
            return None
        key = plan if plan is not None else (name, meta)
        action = self._actions.get(key)
        if action is None:
            if len(self._actions) >= CAPACITY:
                self._actions.clear()
            action = self._actions[key] = Collective.of("allreduce", (name,), (meta,), 1)
        return action

