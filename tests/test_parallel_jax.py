"""Runs tests/parallel_jax/ (ringtrain.jax on N ranks) as real mpiexec jobs, each with a hard timeout.

The whole directory at 2 ranks; collectives, gradients and the optimizer's equivalence with one process at 3
(uneven blocks and shards, a root that is neither first nor last); both through the XLA FFI
handler (RINGTRAIN_JAX_LOWERING=ffi wherever a C++ compiler is present: a failed build fails them). Errors and
the optimizer again at 2 through JAX's Python host callback, the fallback where the handler cannot be built
(tests/test_jax_host_call.py runs that lowering over every dtype in one process). The example at 2 (>= 0.9 test
accuracy). Each job sets XLA to one thread per rank (ranks share the cores), and the jobs share JAX's persistent
compilation cache (one directory per test session): a program one job compiled, the next loads instead of compiling
it again (every program is still traced and lowered through the lowering under test). Without the jax extra these tests
skip with a reason; CI (RINGTRAIN_REQUIRE_EXTRAS=1, every extra installed) fails instead, so it never drops them.

By hand:  mpiexec -n 2 python -m pytest --with-mpi tests/parallel_jax
"""
import os
import re
import shutil
import subprocess
import sys

import pytest

from extras import need

need("jax")
need("optax")

from ringtrain.launch import run
from test_parallel import run_job

# where a C++ compiler is present the FFI handler must build (a failed build fails the jobs); elsewhere the
# collectives fall back to the host callback with a warning, which the jobs then test
FFI = "ffi" if shutil.which(os.environ.get("CXX", "c++").split()[0]) else "auto"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARALLEL_JAX_DIR = os.path.join(REPO, "tests", "parallel_jax")
JOB_TIMEOUT_S = int(os.environ.get("RINGTRAIN_TEST_JOB_TIMEOUT_S", "600"))


def files(*names):
    return [os.path.join(PARALLEL_JAX_DIR, name) for name in names]


@pytest.fixture(scope="module")
def compilation_cache(tmp_path_factory):
    """The environment that points every job's JAX at one persistent compilation cache, for every program."""
    return {"JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("jax-compilation-cache")),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("num_ranks, target, lowering", [
    (2, PARALLEL_JAX_DIR, FFI),
    # at 3 the optimizer's equivalence with one process (the rest of that file -- compression, other collectives
    # in the step, broadcast, ordering -- does not depend on the number of ranks and runs at 2)
    (3, files("test_jax_collectives.py", "test_jax_gradients.py",
              "test_jax_optimizer.py::test_n_ranks_equal_one_process_on_the_whole_batch"), FFI),
    (2, files("test_jax_errors.py", "test_jax_optimizer.py"), "callback"),
], ids=["2-all", "3-collectives-gradients-optimizer", "2-host-callback"])
def test_parallel_jax_suite(num_ranks, target, lowering, compilation_cache):
    run_job(num_ranks, target, JOB_TIMEOUT_S, extra_env={"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false",
                                                          "RINGTRAIN_JAX_LOWERING": lowering, **compilation_cache})


@pytest.mark.timeout(300)
def test_example_learns_digits_on_two_ranks(tmp_path, compilation_cache):
    """examples/jax_train.py at 2 ranks with the linear-scaling rule reaches 0.9 test accuracy (~0.97 in 15 epochs;
    chance is 0.1)."""
    script = os.path.join(REPO, "examples", "jax_train.py")
    env = dict(os.environ, OMP_NUM_THREADS="1", **compilation_cache,
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    done = subprocess.run([run.find_mpiexec(), "-n", "2", sys.executable, script, "--epochs", "10"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=240, start_new_session=True)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    found = re.search(r"final: 2 ranks, .* test accuracy ([0-9.]+)", out)
    assert found, out
    assert float(found.group(1)) >= 0.9, out
