"""Keep tests/parallel/, tests/parallel_tf/ and tests/parallel_jax/ out of the single-process run: those tests need N ranks and run as
mpiexec jobs, launched by tests/test_parallel.py, tests/test_parallel_tf.py and tests/test_parallel_jax.py. Under
`mpiexec ... pytest --with-mpi tests/parallel` they are collected as usual.

Tests of an optional framework skip, naming its extra, where the extra is not installed (tests/extras.py); with
RINGTRAIN_REQUIRE_EXTRAS=1 (.ci/run, which installs every extra) such a skip is a failure instead."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # tests/extras.py, tests/docs_checks.py

HERE = os.path.dirname(os.path.abspath(__file__))
# TensorFlow's optional imports of scikit-learn, matplotlib, JAX and SciPy skipped (~3.5 s of CPU per TF process):
# here, and in every process a test starts, through PYTHONPATH (tests/startup/skip_optional_imports.py says why)
STARTUP = os.path.join(HERE, "startup")
if STARTUP not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join([STARTUP] + ([os.environ["PYTHONPATH"]]
                                                             if os.environ.get("PYTHONPATH") else []))
sys.path.insert(0, STARTUP)
import skip_optional_imports  # noqa: E402

skip_optional_imports.install()

PARALLEL_DIRS = [os.path.join(HERE, "parallel"), os.path.join(HERE, "parallel_tf"), os.path.join(HERE, "parallel_jax")]


def pytest_ignore_collect(collection_path, config):
    if config.getoption("--with-mpi", default=False):
        return None
    path = os.path.abspath(str(collection_path))
    if any(path == d or path.startswith(d + os.sep) for d in PARALLEL_DIRS):
        return True
    return None


# ---- absent extras: a skip with a reason in a minimal install, a failure in CI (RINGTRAIN_REQUIRE_EXTRAS=1) ----
import pytest  # noqa: E402

from extras import required_missing  # noqa: E402

REQUIRE_EXTRAS = os.environ.get("RINGTRAIN_REQUIRE_EXTRAS") == "1"


def _skip_reason(report):
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


def _fail_required_skip(report):
    if REQUIRE_EXTRAS and report.skipped and required_missing(_skip_reason(report)):
        report.outcome = "failed"
        report.longrepr = (f"RINGTRAIN_REQUIRE_EXTRAS=1 (every extra installed, as in CI), but: "
                           f"{_skip_reason(report)}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_required_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_required_skip(outcome.get_result())
