"""Per-rank test data for the parallel jobs, and its float64 sum over the ranks (the numpy reference)."""
import numpy as np


def data(n, salt, rank):
    """n float32 values that differ by rank and by salt (a test's calls must not share data)."""
    return ((np.arange(n) % 11) + 3 * rank + salt).astype(np.float32)


def total(n, salt, size):
    """The sum of every rank's data(n, salt, rank), in float64."""
    return sum(data(n, salt, r).astype(np.float64) for r in range(size))
