"""Runs tests/parallel_tf/ (ringtrain.tensorflow and ringtrain.keras on N ranks) as real mpiexec jobs.

A separate job from tests/parallel/: importing TensorFlow costs seconds per process, so these run at 2 and 3 ranks
only. Without TensorFlow installed the job is skipped on a developer machine, but FAILS in CI (CI=true or
RINGTRAIN_REQUIRE_TF=1): the TF tests must never silently disappear there.

By hand:  mpiexec -n 2 python -m pytest --with-mpi tests/parallel_tf
"""
import importlib.util
import os

import pytest

from test_parallel import run_job

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARALLEL_TF_DIR = os.path.join(REPO, "tests", "parallel_tf")
JOB_TIMEOUT_S = int(os.environ.get("RINGTRAIN_TEST_JOB_TIMEOUT_S", "600"))


def tensorflow_required():
    flag = os.environ.get("RINGTRAIN_REQUIRE_TF", os.environ.get("CI", ""))
    return flag.lower() not in ("", "0", "false", "no")


def require_tensorflow():
    missing = [name for name in ("tensorflow", "keras") if importlib.util.find_spec(name) is None]
    if not missing:
        return
    message = f"{' and '.join(missing)} not installed (pip install -e '.[tensorflow]')"
    if tensorflow_required():
        pytest.fail(message + "; CI / RINGTRAIN_REQUIRE_TF needs the TensorFlow tests to run", pytrace=False)
    pytest.skip(message)


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("num_ranks", [2, 3])
def test_parallel_tf_suite(num_ranks):
    require_tensorflow()
    run_job(num_ranks, PARALLEL_TF_DIR, JOB_TIMEOUT_S,
            extra_env={"TF_CPP_MIN_LOG_LEVEL": "2"})   # TF's C++ start-up chatter would bury the output tail
