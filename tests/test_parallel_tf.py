"""Runs tests/parallel_tf/ (ringtrain.tensorflow and ringtrain.keras on N ranks) as real mpiexec jobs.

A separate job from tests/parallel/: importing TensorFlow costs seconds per process and a Keras fit is slow on
shared cores, so everything runs at 2 ranks, and at 3 the collectives (where uneven splits need a third rank) and
independent collectives created in a different order on each rank. Without TensorFlow installed the jobs skip with a reason, but FAIL in CI
(RINGTRAIN_REQUIRE_EXTRAS=1, set by .ci/run): the TF tests must never silently disappear there.

By hand:  mpiexec -n 2 python -m pytest --with-mpi tests/parallel_tf
"""
import importlib.util
import os

import pytest

from extras import need
from test_parallel import run_job

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARALLEL_TF_DIR = os.path.join(REPO, "tests", "parallel_tf")
JOB_TIMEOUT_S = int(os.environ.get("RINGTRAIN_TEST_JOB_TIMEOUT_S", "600"))


def require_tensorflow():
    """Skip where the tensorflow extra is missing; with RINGTRAIN_REQUIRE_EXTRAS=1 (CI) that is a failure."""
    for name in ("tensorflow", "keras"):
        if importlib.util.find_spec(name) is None:
            need(name, "tensorflow")


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("num_ranks, target", [
    (2, PARALLEL_TF_DIR),
    # 3 ranks: the collectives, and independent collectives created in a different order on each rank (one job:
    # TensorFlow starts once per rank)
    (3, [os.path.join(PARALLEL_TF_DIR, name) for name in ("test_tf_collectives.py", "test_tf_collective_order.py")]),
])
def test_parallel_tf_suite(num_ranks, target):
    require_tensorflow()
    run_job(num_ranks, target, JOB_TIMEOUT_S,
            extra_env={"TF_CPP_MIN_LOG_LEVEL": "2",      # TF's C++ start-up chatter would bury the output tail
                       "RINGTRAIN_STALL_TIMEOUT_S": "20"})   # a deadlock of the order tests fails quickly
