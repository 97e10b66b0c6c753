"""The examples run end to end on one rank: train.py learns digits, checkpoints and resumes; the benchmark reports."""
import os
import re
import subprocess
import sys

import torch

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def run_example(script, *args, cwd):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(EXAMPLES),
                                                                     os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, os.path.join(EXAMPLES, script), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_train_learns_checkpoints_and_resumes(tmp_path):
    out = run_example("train.py", "--epochs", "4", "--lr", "2", "--no-progress", "--threads", "1", cwd=tmp_path)
    accuracy = float(re.search(r"final: .* test accuracy ([0-9.]+)", out).group(1))
    assert accuracy > 0.5, out                 # chance is 0.1; 4 epochs at lr 2 reach ~0.74
    checkpoint = torch.load(tmp_path / "train_checkpoint.pt", weights_only=True)
    assert checkpoint["epoch"] == 4 and "0.weight" in checkpoint["model"]
    assert not [p for p in os.listdir(tmp_path) if ".tmp." in p]       # the atomic write left no temp file
    out = run_example("train.py", "--epochs", "6", "--lr", "2", "--no-progress", "--threads", "1", "--resume",
                      cwd=tmp_path)
    assert "resumed from train_checkpoint.pt after epoch 4" in out
    assert "epoch   5/6" in out and "epoch   4/6" not in out
    resumed = float(re.search(r"final: .* test accuracy ([0-9.]+)", out).group(1))
    assert resumed > accuracy, out           # kept learning from the checkpoint (~0.81)


def test_synthetic_benchmark_reports_throughput(tmp_path):
    out = run_example("synthetic_benchmark.py", "--model", "mlp", "--batch-size", "8", "--num-warmup-batches", "1",
                      "--num-batches-per-iter", "2", "--num-iters", "2", "--threads", "1", cwd=tmp_path)
    total = float(re.search(r"total_img_s=([0-9.]+)", out).group(1))
    assert total > 0 and "img/s per rank (rank 0)" in out
