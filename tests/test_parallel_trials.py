"""examples/parallel_trials.py as one 4-rank job: two 2-rank trials on their own process sets, each matching
one-process training on its ranks' concatenated batches (--verify), with different learning rates and results."""
import os
import re
import subprocess
import sys

from ringtrain.launch import run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_two_trials_in_one_job():
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    cmd = [run.find_mpiexec(), "-n", "4", sys.executable, "-m", "mpi4py",
           os.path.join(REPO, "examples", "parallel_trials.py"), "--epochs", "2", "--verify"]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = re.findall(r"trial (\d)  ranks \[(\d), (\d)\]  lr (\S+)\s+test loss (\S+)  test accuracy (\S+)  "
                       r"max \|param - one-process param\| (\S+)", done.stdout)
    assert [(t, a, b, lr) for t, a, b, lr, *_ in lines] == [("0", "0", "1", "0.05"), ("1", "2", "3", "0.5")], \
        done.stdout
    for *_, loss, accuracy, diff in lines:
        assert float(diff) < 1e-5, done.stdout          # each trial == one process on its concatenated batches
    assert lines[0][4] != lines[1][4]                    # different learning rates, different models
    assert float(lines[1][5]) > 0.5, done.stdout         # lr 0.5 learns digits in 2 epochs (chance: 0.1)
