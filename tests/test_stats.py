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


def test_a_drained_batch_counts_as_its_calls_one_by_one():
    """add_many (the compiled express calls' drain): the same count, bytes, seconds and reservoir as add() per call,
    in uneven batches past the reservoir's size; samples a batch lacks still count (and are missing only from the
    reservoir)."""
    one, batched = CommStats(), CommStats()
    a, b = one.op("allreduce"), batched.op("allreduce")
    rng = np.random.default_rng(3)
    durations = rng.random(3 * RESERVOIR_SIZE).tolist()
    i = 0
    while i < len(durations):
        k = int(rng.integers(1, 700))
        batch = durations[i:i + k]
        for d in batch:
            a.add(16, d)
        b.add_many(len(batch), 16 * len(batch), sum(batch), batch)
        i += k
    x, y = one.local()["allreduce"], batched.local()["allreduce"]
    assert (x["count"], x["bytes"], x["samples"]) == (y["count"], y["bytes"], y["samples"])
    assert abs(x["seconds"] - y["seconds"]) < 1e-9
    b.add_many(10, 160, 1.0, [0.25, 0.25])          # 8 of 10 samples lost: counted all the same
    assert batched.local()["allreduce"]["count"] == x["count"] + 10
