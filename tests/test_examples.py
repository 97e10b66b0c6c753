"""Every example in examples/ runs as a real 2-rank job and does what README.md and examples/README.md say it does.

The quickstart's command (`mpirun -np 2 python examples/train.py`, no flags) must reach the test accuracy the README
promises: the README shows its real output. The last test fails when an example is added without a run here (or in
the test file named for it in COVERED_ELSEWHERE).
"""
import glob
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from extras import MISSING
from ringtrain.launch import run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "examples")
HELPER_MODULES = {"data.py"}                                     # imported by the examples, not run on its own
# examples that another test file already runs as a multi-rank job (the runs there are costlier than a repeat here)
COVERED_ELSEWHERE = {"parallel_trials.py": "tests/test_parallel_trials.py", "jax_train.py": "tests/test_parallel_jax.py",
                     "elastic_train.py": "tests/test_elastic.py", "keras_elastic_train.py": "tests/test_elastic.py"}
JOB_TIMEOUT_S = 300


def run_example(script, *args, ranks=2, cwd):
    """`mpirun -np <ranks> python examples/<script> <args>`, as a user types it, from `cwd`."""
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    cmd = [run.find_mpiexec(), "-n", str(ranks), sys.executable, "-m", "mpi4py", os.path.join(EXAMPLES, script),
           *args]
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def final_accuracy(out):
    return float(re.search(r"final: .*test accuracy ([0-9.]+)", out).group(1))


# sha256 of pixels (float32) then labels (int64) as sklearn.datasets.load_digits() gives them, pixels / 16 (taken
# with scikit-learn 1.x: its digits.csv.gz has not changed since it was added)
DIGITS_SHA256 = "8b3b6ae90863430bdef06a3f7d1ec2f6a905a53d3375655b18cf63780ad98772"


def test_the_examples_read_sklearns_digits_as_sklearn_does():
    """examples/data.py reads scikit-learn's digits file itself (importing sklearn.datasets costs every rank
    seconds): the same 1,797 rows, pixels in [0, 1], labels 0-9, bit for bit, and the split is a partition."""
    import hashlib
    import importlib.util
    if importlib.util.find_spec("sklearn") is None:      # (found, not imported: importing it is what data.py avoids)
        pytest.skip(f"sklearn is missing: the [test] {MISSING} (pip install -e \".[test]\")")
    spec = importlib.util.spec_from_file_location("examples_data", os.path.join(EXAMPLES, "data.py"))
    data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(data)
    x, y = data.load_digits()
    assert (x.shape, x.dtype, y.shape, y.dtype) == ((1797, 64), np.float32, (1797,), np.int64)
    assert x.min() == 0 and x.max() == 1 and sorted(set(y.tolist())) == list(range(10))
    assert hashlib.sha256(x.tobytes() + y.tobytes()).hexdigest() == DIGITS_SHA256
    (x_train, y_train), (x_test, y_test) = data.load_digits_split(0.2, seed=0)
    assert (len(y_train), len(y_test)) == (1438, 359)
    rows = sorted(map(bytes, np.concatenate([x_train, x_test])))
    assert rows == sorted(map(bytes, x))


def test_numpy_allreduce(tmp_path):
    out = run_example("numpy_allreduce.py", cwd=tmp_path)
    for rank in (0, 1):                       # 1s and 2s average to 1.5; 1 + 2 rows gathered; rank 0's config
        assert f"rank {rank}/2 via " in out and "mean=[1.5 1.5 1.5 1.5] rows=3 config={'lr': 0.2}" in out, out


def test_train_quickstart_reaches_the_readme_accuracy(tmp_path):
    out = run_example("train.py", cwd=tmp_path)          # the README's command, defaults and all
    assert "epoch  20/20" in out and final_accuracy(out) >= 0.9, out
    assert os.path.exists(tmp_path / "train_checkpoint.pt")


def test_gpu_train_runs_on_the_cpu_without_a_gpu(tmp_path):
    out = run_example("gpu_train.py", "--fp16-allreduce", cwd=tmp_path)
    assert re.search(r"ranks 2  device (cpu|cuda:\d)", out), out
    assert final_accuracy(out) >= 0.9, out


def test_synthetic_benchmark_two_ranks(tmp_path):
    out = run_example("synthetic_benchmark.py", "--model", "mlp", "--batch-size", "8", "--num-warmup-batches", "1",
                      "--num-batches-per-iter", "2", "--num-iters", "2", "--threads", "1", cwd=tmp_path)
    assert float(re.search(r"total_img_s=([0-9.]+)", out).group(1)) > 0, out


@pytest.mark.parametrize("script", ["tf_train.py", "keras_train.py"])
def test_tensorflow_examples(script, tmp_path):
    pytest.importorskip("tensorflow", reason="tensorflow is missing: the [tensorflow] extra is not installed")
    out = run_example(script, "--epochs", "8", cwd=tmp_path)
    assert final_accuracy(out) >= 0.8, out              # 20 epochs reach ~0.95; 8 are past 0.85


def test_horovod_tensorflow2_example_with_only_the_import_changed(tmp_path):
    """Horovod's TF2 script as examples/README.md runs it: DistributedGradientTape with op=Adasum. It learns, and
    every rank ends with bitwise the same weights. (Its --distributed-optimizer path, hvd.DistributedOptimizer on a
    Keras optimizer, is the one tests/parallel_tf/test_tf_training.py checks against one process.)"""
    pytest.importorskip("tensorflow", reason="tensorflow is missing: the [tensorflow] extra is not installed")
    out = run_example("tensorflow2_mnist.py", "--steps", "150", "--use-adasum", cwd=tmp_path)
    assert "largest weight difference between ranks 0\n" in out + "\n", out
    assert float(re.search(r"test accuracy ([0-9.]+)", out).group(1)) >= 0.85, out
    assert "op Adasum" in out, out


def test_every_example_is_run_by_a_test():
    this_file = open(__file__).read()
    for path in sorted(glob.glob(os.path.join(EXAMPLES, "*.py"))):
        name = os.path.basename(path)
        if name in HELPER_MODULES:
            continue
        if name in COVERED_ELSEWHERE:
            assert name in open(os.path.join(REPO, COVERED_ELSEWHERE[name])).read(), name
            continue
        assert f'"{name}"' in this_file, f"examples/{name} has no test that runs it"
