"""Running an elastic job for a test: `ringtrain-run` in elastic mode on a script of tests/elastic_scripts/, with a
hard timeout (its process group is killed and the test fails with the output), so nothing can hang CI."""
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "elastic_scripts"
HARD_KILL_S = int(os.environ.get("RINGTRAIN_TEST_HARD_KILL_S", "150"))

needs_mpiexec = pytest.mark.skipif(
    shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")) is None,
    reason="mpiexec not found")


class Job:
    def __init__(self, returncode, seconds, output):
        self.returncode, self.seconds, self.output = returncode, seconds, output

    def lines(self, tag):
        """{rank: [fields dict per line]} of the 'rank r: TAG k=v ...' lines."""
        found = {}
        for rank, rest in re.findall(rf"^rank (\d+): {tag} (.*)$", self.output, re.M):
            found.setdefault(int(rank), []).append(dict(re.findall(r"(\w+)=(\S+)", rest)))
        return found

    def __str__(self):
        return f"exit {self.returncode} after {self.seconds:.1f}s; output:\n{self.output[-12000:]}"


def run_elastic(*launcher_args, script="train_counts.py", **env):
    environ = dict(os.environ)
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), environ.get("PYTHONPATH", "")]))
    environ.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", RINGTRAIN_STALL_TIMEOUT_S="60")
    environ.update({k: str(v) for k, v in env.items()})
    cmd = [sys.executable, "-m", "ringtrain.launch.run", *launcher_args, sys.executable, str(SCRIPTS / script)]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=HARD_KILL_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"elastic job {launcher_args} still running after {HARD_KILL_S}s:\n{out[-12000:]}")
    job = Job(proc.returncode, time.monotonic() - start, out)
    print(job)
    return job
