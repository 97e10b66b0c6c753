"""Runs tests/parallel_jax/ (ringtrain.jax on N ranks) as real mpiexec jobs, each with a hard timeout.

The whole directory at 2 ranks; the collectives and gradients at 3 (uneven blocks and a root that is neither
first nor last); the optimizer's equivalence with one process, and the example, at 4. JAX is part of the README's
install command: without it these tests fail rather than skip, so CI can never silently drop them.

By hand:  mpiexec -n 2 python -m pytest --with-mpi tests/parallel_jax
"""
import os

import jax  # noqa: F401  (fails the run loudly where the jax extra is missing)
import pytest

from test_parallel import run_job

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARALLEL_JAX_DIR = os.path.join(REPO, "tests", "parallel_jax")
JOB_TIMEOUT_S = int(os.environ.get("RINGTRAIN_TEST_JOB_TIMEOUT_S", "600"))


def files(*names):
    return [os.path.join(PARALLEL_JAX_DIR, name) for name in names]


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("num_ranks, target", [
    (2, PARALLEL_JAX_DIR),
    (3, files("test_jax_collectives.py", "test_jax_gradients.py")),
], ids=["2-all", "3-collectives"])
def test_parallel_jax_suite(num_ranks, target):
    run_job(num_ranks, target, JOB_TIMEOUT_S, extra_env={"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false"})
