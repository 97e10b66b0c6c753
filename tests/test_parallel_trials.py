"""examples/parallel_trials.py as one 4-rank job: two 2-rank trials on their own process sets, each matching
one-process training on its ranks' concatenated batches (--verify), with different learning rates and results."""
import os
import re
import sys

import pytest

from job_runner import Job, Launch
from ringtrain.launch import run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def trials_launch(runner):
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    return Launch([run.find_mpiexec(), "-n", "4", sys.executable, "-m", "mpi4py",
                   os.path.join(REPO, "examples", "parallel_trials.py"), "--epochs", "2", "--verify"], env, REPO)


@pytest.mark.timeout(360)
@pytest.mark.parametrize("job", [Job("parallel-trials", trials_launch, 300)], ids=["4"])
def test_two_trials_in_one_job(job, jobs):
    done = jobs.result(job)
    assert done.returncode == 0, done.output
    lines = re.findall(r"trial (\d)  ranks \[(\d), (\d)\]  lr (\S+)\s+test loss (\S+)  test accuracy (\S+)  "
                       r"max \|param - one-process param\| (\S+)", done.output)
    assert [(t, a, b, lr) for t, a, b, lr, *_ in lines] == [("0", "0", "1", "0.05"), ("1", "2", "3", "0.5")], \
        done.output
    for *_, loss, accuracy, diff in lines:
        assert float(diff) < 1e-5, done.output          # each trial == one process on its concatenated batches
    assert lines[0][4] != lines[1][4]                    # different learning rates, different models
    assert float(lines[1][5]) > 0.5, done.output         # lr 0.5 learns digits in 2 epochs (chance: 0.1)
