"""A test that fails on some ranks only must not take the rest of a parallel run down with it: tests/rank_recovery.py
(the plugin tests/parallel and tests/parallel_tf load) brings the ranks back in step. Runs
tests/recovery_scripts/diverging_tests.py on 2 ranks with a 60 s stall timeout: both divergences recover in seconds,
without waiting for a stall, and the tests after each pass on both ranks."""
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from ringtrain.launch import run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "tests", "recovery_scripts", "diverging_tests.py")
MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
MUST_END_S = 30.0

pytestmark = pytest.mark.skipif(MPIEXEC is None or run.mpi_flavor(MPIEXEC) != "hydra",
                                reason="needs MPICH's mpiexec (-prepend-rank tells the ranks' lines apart)")


def test_ranks_recover_after_a_test_fails_on_one_rank():
    env = dict(os.environ, RINGTRAIN_STALL_TIMEOUT_S="60", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests")]))
    started = time.monotonic()
    job = subprocess.run([MPIEXEC, "-prepend-rank", "-n", "2", sys.executable, "-m", "pytest", "-p", "rank_recovery",
                          "-p", "no:cacheprovider", "-q", "-rA", "--timeout=60", SCRIPT],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    seconds = time.monotonic() - started
    outcomes = {(int(rank), test): outcome for rank, outcome, test in
                # not anchored at a line start: mpiexec's "[r] " prefix can land mid-line when another rank's last
                # line had no newline yet ("... passed in 0.65s[1] FAILED tests/...")
                re.findall(r"\[(\d+)\] (PASSED|FAILED) \S+::(\w+)", job.stdout + job.stderr)}
    want = {(0, "test_rank0_fails_while_rank1_waits_in_a_collective"): "FAILED",
            (1, "test_rank0_fails_while_rank1_waits_in_a_collective"): "FAILED",   # its collective ends at once
            (0, "test_both_ranks_work_after_the_first_divergence"): "PASSED",
            (1, "test_both_ranks_work_after_the_first_divergence"): "PASSED",
            (0, "test_rank1_fails_after_its_last_collective"): "PASSED",
            (1, "test_rank1_fails_after_its_last_collective"): "FAILED",
            (0, "test_both_ranks_work_after_the_second_divergence"): "PASSED",
            (1, "test_both_ranks_work_after_the_second_divergence"): "PASSED"}
    assert outcomes == want, f"after {seconds:.1f}s:\n{job.stdout[-6000:]}\n{job.stderr[-3000:]}"
    assert seconds < MUST_END_S, f"recovery took {seconds:.1f}s: it waited for a stall"
