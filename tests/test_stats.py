"""The per-op statistics' reservoir (ringtrain/stats.py): bounded, and a uniform sample of every duration seen."""
import numpy as np

from ringtrain.stats import RESERVOIR_SIZE, CommStats


def test_the_reservoir_is_a_uniform_sample_of_every_collective():
    stats = CommStats()
    recorder = stats.op("allreduce")
    n = 25 * RESERVOIR_SIZE
    for i in range(n):
        recorder.add(8, float(i))
    mine = stats.local()["allreduce"]
    assert mine["count"] == n and mine["bytes"] == 8 * n and mine["seconds"] == float(n * (n - 1) // 2)
    samples = np.array(mine["samples"])
    assert len(samples) == RESERVOIR_SIZE and len(set(samples)) == RESERVOIR_SIZE
    # uniform over 0 .. n-1: every tenth of the run holds a tenth of the reservoir (binomial: 3 sigma ~ 4.5%)
    counts = np.bincount((samples * 10 // n).astype(int), minlength=10)
    assert np.all(np.abs(counts / RESERVOIR_SIZE - 0.1) < 0.02), counts
    assert abs(samples.mean() / n - 0.5) < 0.02, samples.mean() / n
