"""Per-op communication statistics, summarised across ranks at shutdown().

The engine calls `record(op_kind, nbytes, seconds)` once per finished collective. `summary(comm)` is collective:
every rank sends its numbers to rank 0 (mpi4py lowercase gather: a few KB of pickled floats), which returns a
table like

    op           count        bytes   mean_ms    p99_ms  slowest rank (mean_ms)
    allreduce      120     1.2 GiB     3.512     9.870  1 (4.101)

count and bytes are per rank (the largest over ranks; they agree in a healthy job), mean and p99 are over every
rank's samples, and "slowest rank" is the rank whose mean time is the largest -- the one the others wait for.
"""
import math
import random
import threading

import numpy as np

# Samples kept per op kind for the p99: a uniform reservoir, so memory stays bounded on long runs.
RESERVOIR_SIZE = 4096


class _OpStats:
    __slots__ = ("count", "nbytes", "seconds", "samples", "_rng", "_w", "_next")

    def __init__(self, seed):
        self.count = 0
        self.nbytes = 0
        self.seconds = 0.0
        self.samples = []
        self._rng = random.Random(seed)
        self._w = 1.0
        self._next = 0          # once the reservoir is full: the count whose sample enters it next (_skip)

    def add(self, nbytes, seconds):
        count = self.count = self.count + 1
        self.nbytes += nbytes
        self.seconds += seconds
        if count <= RESERVOIR_SIZE:
            self.samples.append(seconds)
            if count == RESERVOIR_SIZE:
                self._skip()
        elif count == self._next:           # (every other sample: one compare)
            self.samples[int(self._rng.random() * RESERVOIR_SIZE)] = float(seconds)
            self._skip()

    def add_many(self, count, nbytes, seconds, samples):
        """`count` collectives at once (the compiled express call's, drained): `samples` are the durations of the
        last len(samples) of them (the earlier ones' are lost to the reservoir, not to the counts)."""
        self.nbytes += nbytes
        self.seconds += seconds
        kept = self.samples
        lost = count - len(samples)
        if lost > 0:
            self.count += lost
            if len(kept) >= RESERVOIR_SIZE and self._next <= self.count:
                self._skip()
        i, n = 0, len(samples)
        while i < n and len(kept) < RESERVOIR_SIZE:
            self.count += 1
            kept.append(samples[i])
            i += 1
            if len(kept) == RESERVOIR_SIZE:
                self._skip()
        base = self.count
        top = base + n - i
        if len(kept) >= RESERVOIR_SIZE and self._next <= top:
            # the replacements, _skip inline (the same draws in the same order): while the count is a few times the
            # reservoir's size a good share of the calls replace a sample, and a drain of thousands of calls spends
            # most of its time here
            draw, log, exp, w, chosen = self._rng.random, math.log, math.exp, self._w, self._next
            while chosen <= top:
                kept[int(draw() * RESERVOIR_SIZE)] = float(samples[i + chosen - base - 1])
                w *= exp(log(max(draw(), 1e-300)) / RESERVOIR_SIZE)
                chosen += int(log(max(draw(), 1e-300)) / log(1.0 - w)) + 1
            self._w, self._next = w, chosen
        self.count = top

    def _skip(self):
        """Algorithm L (Li 1994): how many samples pass before the next one replaces a kept one, drawn once per
        replacement. The reservoir is a uniform sample of every sample so far, as with a coin per sample
        (Algorithm R), which costs a random draw per collective."""
        rng = self._rng
        self._w *= math.exp(math.log(max(rng.random(), 1e-300)) / RESERVOIR_SIZE)
        self._next = self.count + int(math.log(max(rng.random(), 1e-300)) / math.log(1.0 - self._w)) + 1


class CommStats:
    """Counts, bytes and durations of this rank's collectives, by op kind ("allreduce", "allgather", ...)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._ops = {}

    def record(self, op_kind, nbytes, seconds):
        nbytes, seconds = int(nbytes), float(seconds)
        with self._lock:
            stats = self._ops.get(op_kind)
            if stats is None:
                stats = self._ops[op_kind] = _OpStats(seed=len(self._ops))
            stats.add(nbytes, seconds)

    def op(self, op_kind):
        """The counts of one op kind (made when missing), for a writer that adds to them directly (add(nbytes: int,
        seconds: float)) without this object's lock: the express path, once per small synchronous allreduce,
        where each Python call is a visible share of its cost. Safe because every writer holds its engine's
        progress lock (the executor records inside a pass, the express path inside its cycle), so writers never
        overlap; a reader (local(), under the lock) sees at worst one collective counted and not yet timed."""
        with self._lock:
            stats = self._ops.get(op_kind)
            if stats is None:
                stats = self._ops[op_kind] = _OpStats(seed=len(self._ops))
            return stats

    def local(self):
        """{op_kind: {"count", "bytes", "seconds", "samples"}} of this rank: what summary() gathers."""
        with self._lock:
            return {kind: {"count": s.count, "bytes": s.nbytes, "seconds": s.seconds, "samples": list(s.samples)}
                    for kind, s in self._ops.items()}

    def rows(self, comm=None):
        """Collective over comm (every rank must call it). Rank 0 (or a comm-less caller) gets one dict per op kind:
        op, count, bytes, mean_s, p99_s, slowest_rank, slowest_mean_s. Other ranks get None."""
        mine = self.local()
        per_rank = [mine] if comm is None else comm.gather(mine, root=0)
        if per_rank is None:
            return None
        kinds = sorted({kind for rank_stats in per_rank for kind in rank_stats})
        rows = []
        for kind in kinds:
            entries = [(r, s[kind]) for r, s in enumerate(per_rank) if kind in s and s[kind]["count"]]
            if not entries:
                continue
            samples = np.concatenate([np.asarray(s["samples"], dtype=np.float64) for _, s in entries])
            total_count = sum(s["count"] for _, s in entries)
            means = [(s["seconds"] / s["count"], r) for r, s in entries]
            slowest_mean, slowest_rank = max(means)
            rows.append({
                "op": kind,
                "count": max(s["count"] for _, s in entries),
                "bytes": max(s["bytes"] for _, s in entries),
                "mean_s": sum(s["seconds"] for _, s in entries) / total_count,
                "p99_s": float(np.percentile(samples, 99)),
                "slowest_rank": slowest_rank,
                "slowest_mean_s": slowest_mean,
            })
        return rows

    def summary(self, comm=None):
        """Collective: rank 0 returns the formatted table (see module docstring), every other rank returns ""."""
        rows = self.rows(comm)
        if rows is None:
            return ""
        return format_table(rows, ranks=1 if comm is None else comm.Get_size())


def format_table(rows, ranks):
    header = f"ringtrain communication summary ({ranks} rank{'s' if ranks != 1 else ''})"
    if not rows:
        return header + ": no collectives ran"
    lines = [header,
             f"{'op':<16}{'count':>9}{'bytes':>12}{'mean_ms':>10}{'p99_ms':>10}  slowest rank (mean_ms)"]
    for row in rows:
        lines.append(f"{row['op']:<16}{row['count']:>9}{human_bytes(row['bytes']):>12}"
                     f"{row['mean_s'] * 1e3:>10.3f}{row['p99_s'] * 1e3:>10.3f}"
                     f"  {row['slowest_rank']} ({row['slowest_mean_s'] * 1e3:.3f})")
    return "\n".join(lines)


def human_bytes(n):
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
