"""Every rank of a `mpiexec -n N python -m pytest --with-mpi tests/parallel` job shares one ringtrain world.

init() once for the whole session (tests that need other settings shutdown() and init() again, and restore it);
shutdown() at the end, so the engine thread and shared windows go before MPI_Finalize.
"""
import pytest

import ringtrain
from ringtrain.core.set_registry import process_sets

# a test that fails on some ranks only: every rank is back in step, with a working engine, for the next test
from rank_recovery import pytest_runtest_makereport, ranks_in_step_after_each_test  # noqa: F401


@pytest.fixture(scope="session", autouse=True)
def ringtrain_world():
    if not ringtrain.is_initialized():
        ringtrain.init()
    yield ringtrain
    if ringtrain.is_initialized():
        ringtrain.shutdown()


@pytest.fixture(scope="module", autouse=True)
def world_left_as_found(request):
    """A module that leaves the world shut down, or a process set registered, breaks whichever module runs next in
    the job (the order differs between the 2-, 3- and 4-rank jobs and a single file run by hand): fail the module
    that did it, by name."""
    yield
    if not ringtrain.is_initialized():
        pytest.fail(f"{request.module.__name__} left ringtrain shut down: a module that shuts the world down must "
                    f"init() it again with the default settings (see tests/parallel/conftest.py)", pytrace=False)
    left = process_sets()[1:]
    if left:
        pytest.fail(f"{request.module.__name__} left process sets registered: {left}", pytrace=False)
