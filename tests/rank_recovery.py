"""pytest plugin for the ranks of a parallel test job: after a test that failed on some ranks only, bring every rank
back in step before the next test.

Without it, a rank that fails an assertion goes on to the next test while its peers still wait inside the failed
test's remaining collectives: the ranks' collectives diverge and every later test stalls. After each test:
- a rank whose test failed (or whose engine failed) calls shutdown(), which ends at once any collective a peer
  still waits on for it (RankFailureError, "rank r already called shutdown()"), then init() with the same settings;
- a rank whose test passed runs one cached allreduce with every rank: when a peer has shut down, it fails at once,
  and this rank recovers the same way. So every rank meets the next test with a fresh, working engine.
Process sets registered before the failure are gone after a recovery (the new world starts without them).

Loaded by tests/parallel/conftest.py and tests/parallel_tf/conftest.py (which import these two names), or with
`-p rank_recovery`.
"""
import dataclasses

import numpy as np
import pytest

import ringtrain
from ringtrain.core import state
from ringtrain.errors import RingtrainError

CHECK_NAME = "rank_recovery.check"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if outcome.get_result().failed:
        item.ringtrain_test_failed = True


def _engine_failed():
    return state.engine().failed is not None


def _recover():
    settings = dataclasses.asdict(ringtrain.config())
    try:
        ringtrain.shutdown()
    except RingtrainError:
        pass
    ringtrain.init(**settings)


@pytest.fixture(autouse=True)
def ranks_in_step_after_each_test(request):
    yield
    if not ringtrain.is_initialized():
        return
    if not getattr(request.node, "ringtrain_test_failed", False) and not _engine_failed():
        try:
            ringtrain.allreduce(np.zeros(1, np.int32), op=ringtrain.Sum, name=CHECK_NAME)
            return
        except RingtrainError:
            pass
    _recover()
