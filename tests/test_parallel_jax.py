"""Runs tests/parallel_jax/ (ringtrain.jax on N ranks) as real mpiexec jobs, each with a hard timeout.

The whole directory at 2 ranks; collectives, gradients and the optimizer's equivalence with one process at 3
(uneven blocks and shards, a root that is neither first nor last); both through the XLA FFI
handler (RINGTRAIN_JAX_LOWERING=ffi wherever a C++ compiler is present: a failed build fails them). Errors and
the optimizer again at 2 through JAX's Python host callback, the fallback where the handler cannot be built
(tests/test_jax_host_call.py runs that lowering over every dtype in one process). The example at 2 (>= 0.9 test
accuracy). Each job sets XLA to one thread per rank (ranks share the cores), and the jobs share JAX's persistent
compilation cache (one directory per test session): the 3-rank job starts once the whole-directory job has ended and
loads the programs that one compiled instead of compiling them again (every program is still traced and lowered
through the lowering under test). Like every launcher test's job, each runs beside the next one (tests/job_runner.py). Without the jax extra these tests
skip with a reason; CI (RINGTRAIN_REQUIRE_EXTRAS=1, every extra installed) fails instead, so it never drops them.

By hand:  mpiexec -n 2 python -m pytest --with-mpi tests/parallel_jax
"""
import os
import re
import shutil
import sys

import pytest

from extras import need

need("jax")
need("optax")

from job_runner import Job, Launch
from ringtrain.launch import run
from test_parallel import check_suite_job, suite_job

# where a C++ compiler is present the FFI handler must build (a failed build fails the jobs); elsewhere the
# collectives fall back to the host callback with a warning, which the jobs then test
FFI = "ffi" if shutil.which(os.environ.get("CXX", "c++").split()[0]) else "auto"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARALLEL_JAX_DIR = os.path.join(REPO, "tests", "parallel_jax")
JOB_TIMEOUT_S = int(os.environ.get("RINGTRAIN_TEST_JOB_TIMEOUT_S", "600"))


def files(*names):
    return [os.path.join(PARALLEL_JAX_DIR, name) for name in names]


def compilation_cache(runner):
    """The environment that points a job's JAX at the session's persistent compilation cache, for every program."""
    return {"JAX_COMPILATION_CACHE_DIR": runner.directory("jax-compilation-cache"),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


def jax_job(name, num_ranks, target, lowering, after=()):
    return suite_job(name, num_ranks, target, JOB_TIMEOUT_S, after=after,
                     extra_env=lambda runner: {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false",
                                               "RINGTRAIN_JAX_LOWERING": lowering, **compilation_cache(runner)})


ALL_AT_2 = jax_job("jax-2-all", 2, PARALLEL_JAX_DIR, FFI)


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("num_ranks, job", [
    (2, ALL_AT_2),
    # through the host callback: other programs than the FFI handler's, so this job runs beside the first
    (2, jax_job("jax-2-host-callback", 2, files("test_jax_errors.py", "test_jax_optimizer.py"), "callback")),
    # at 3 the optimizer's equivalence with one process (the rest of that file -- compression, other collectives
    # in the step, broadcast, ordering -- does not depend on the number of ranks and runs at 2); it starts after
    # the first job, whose compiled programs it finds in the cache
    (3, jax_job("jax-3", 3, files("test_jax_collectives.py", "test_jax_gradients.py",
                                  "test_jax_optimizer.py::test_n_ranks_equal_one_process_on_the_whole_batch"), FFI,
                after=(ALL_AT_2,))),
], ids=["2-all", "2-host-callback", "3-collectives-gradients-optimizer"])
def test_parallel_jax_suite(num_ranks, job, jobs):
    check_suite_job(jobs.result(job), num_ranks)


def example_launch(runner):
    env = dict(os.environ, OMP_NUM_THREADS="1", **compilation_cache(runner),
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    return Launch([run.find_mpiexec(), "-n", "2", sys.executable, os.path.join(REPO, "examples", "jax_train.py"),
                   "--epochs", "10"], env, runner.directory("jax-example"))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("job", [Job("jax-example", example_launch, 240)], ids=["2"])
def test_example_learns_digits_on_two_ranks(job, jobs):
    """examples/jax_train.py at 2 ranks with the linear-scaling rule reaches 0.9 test accuracy (~0.97 in 15 epochs;
    chance is 0.1)."""
    done = jobs.result(job)
    out = done.output
    assert done.returncode == 0, out
    found = re.search(r"final: 2 ranks, .* test accuracy ([0-9.]+)", out)
    assert found, out
    assert float(found.group(1)) >= 0.9, out
