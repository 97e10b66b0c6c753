"""Every rank of a `mpiexec -n N python -m pytest --with-mpi tests/parallel` job shares one ringtrain world.

init() once for the whole session (tests that need other settings shutdown() and init() again, and restore it);
shutdown() at the end, so the engine thread and shared windows go before MPI_Finalize.
"""
import pytest

import ringtrain

# a test that fails on some ranks only: every rank is back in step, with a working engine, for the next test
from rank_recovery import pytest_runtest_makereport, ranks_in_step_after_each_test  # noqa: F401


@pytest.fixture(scope="session", autouse=True)
def ringtrain_world():
    if not ringtrain.is_initialized():
        ringtrain.init()
    yield ringtrain
    if ringtrain.is_initialized():
        ringtrain.shutdown()
