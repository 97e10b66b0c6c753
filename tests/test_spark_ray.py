"""ringtrain.spark.run and ringtrain.ray.run place 2 ranks (one local Spark session and one local Ray instance,
each shared by its tests): a small training function returns on every rank exactly what the same function returns
under mpiexec, and a rank that fails ends the job with that rank named and no rank left running."""
import json
import re
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from ringtrain.launch import run
from ringtrain.launch.task import RankFailedError
from ringtrain.engine.watchdog import _alive

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(REPO, "tests", "launcher_scripts")
sys.path.insert(0, SCRIPTS)
import train_fn  # noqa: E402  (tests/launcher_scripts/train_fn.py)

cloudpickle = pytest.importorskip("cloudpickle")
cloudpickle.register_pickle_by_value(train_fn)      # the tasks need not import the test's helper module
ENV = {"PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1",
       "RINGTRAIN_STALL_TIMEOUT_S": "60"}


@pytest.fixture(scope="module")
def mpirun_result():
    """What the training function returns on each rank of `mpiexec -n 2 python train_fn.py`."""
    proc = subprocess.run([run.find_mpiexec(), "-n", "2", sys.executable, os.path.join(SCRIPTS, "train_fn.py")],
                          env=dict(os.environ, **ENV), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the two ranks' lines can reach mpiexec's stdout glued together ("RESULT {...}RESULT {...}"): decode each
    # JSON object where its marker starts, not line by line
    decoder = json.JSONDecoder()
    results = sorted((decoder.raw_decode(proc.stdout, m.end())[0] for m in re.finditer("RESULT ", proc.stdout)),
                     key=lambda r: r["rank"])
    assert [r["size"] for r in results] == [2, 2]
    return results


@pytest.fixture(autouse=True)
def rank_environment(monkeypatch):
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)


def assert_same_training(got, want):
    assert [(r["rank"], r["size"]) for r in got] == [(0, 2), (1, 2)]
    for mine, theirs in zip(got, want):
        np.testing.assert_allclose(mine["w"], theirs["w"], rtol=1e-12, atol=0)


def assert_failure_named_and_nothing_left(error, pid_dir):
    assert error.value.rank == 1 and "ringtrain rank 1 failed: RuntimeError: planted failure on rank 1" in \
        str(error.value)
    pids = [int(open(os.path.join(pid_dir, f)).read()) for f in os.listdir(pid_dir)]
    assert pids, "no rank got as far as writing its pid"
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)], "ranks left running after the failure"


# ---- one local Spark session, then one local Ray instance, each shared by both tests ----

def _spark_session():
    pytest.importorskip("pyspark")
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("Spark needs a Java runtime")
    from pyspark.sql import SparkSession
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    session = (SparkSession.builder.master("local[2]").appName("ringtrain-tests")
               .config("spark.ui.enabled", "false").getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    import ringtrain.spark
    return (lambda fn, **kwargs: ringtrain.spark.run(fn, kwargs=kwargs, num_proc=2)), session.stop


def _ray_instance():
    ray = pytest.importorskip("ray")
    temp_dir = tempfile.mkdtemp(prefix="rtray")      # short: Ray puts unix sockets in it
    for attempt in (1, 2):
        try:
            # a new local instance with its own temp dir: never another job's Ray on a shared machine
            ray.init(address="local", _temp_dir=temp_dir, num_cpus=2,
                     include_dashboard=False, log_to_driver=False, configure_logging=False)
            break
        except Exception:     # Ray waits a fixed 30 s for its raylet: a heavily loaded machine can miss that once
            ray.shutdown()
            if attempt == 2:
                raise
    import ringtrain.ray

    def stop():
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
    return (lambda fn, **kwargs: ringtrain.ray.run(fn, kwargs=kwargs, num_workers=2)), stop


@pytest.fixture(scope="module", params=["spark", "ray"])
def place(request):
    """run(fn, **kwargs) on 2 ranks placed by Spark or Ray."""
    run_on_two, stop = {"spark": _spark_session, "ray": _ray_instance}[request.param]()
    yield run_on_two
    stop()


@pytest.mark.timeout(300)
def test_trains_like_mpirun(place, mpirun_result):
    assert_same_training(place(train_fn.train), mpirun_result)


@pytest.mark.timeout(300)
def test_failing_rank_is_named_and_no_rank_is_left_running(place, tmp_path):
    with pytest.raises(RankFailedError) as error:
        place(train_fn.train, fail_rank=1, pid_dir=str(tmp_path))
    assert_failure_named_and_nothing_left(error, str(tmp_path))
