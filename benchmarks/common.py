"""Helpers every benchmark shares: nccl-tests-style tables, JSON records, plots and size formatting.

Kept free of MPI, torch and ringtrain imports so the scaling model (which only reads JSON) stays light.
"""
import json
import math
import os
import platform
import subprocess
import time

# The record keys of allreduce results; every record carries at least these.
ALLREDUCE_KEYS = ("impl", "ranks", "bytes", "dtype", "op", "time_us", "algbw_gbps", "busbw_gbps", "wrong")


def human_bytes(nbytes):
    """4 -> '4 B', 4096 -> '4 KB', 1 << 20 -> '1 MB' (powers of 1024, as nccl-tests' size column)."""
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1024 or unit == "GB":
            return f"{nbytes:g} {unit}" if nbytes == int(nbytes) else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes} GB"


def size_ladder(min_bytes, max_bytes, factor=4):
    """min_bytes, min_bytes*factor, ... up to and including max_bytes."""
    sizes, nbytes = [], min_bytes
    while nbytes <= max_bytes:
        sizes.append(nbytes)
        nbytes *= factor
    return sizes


def bus_bandwidth(algbw, ranks):
    """nccl-tests' rule for allreduce: each rank sends and receives 2(N-1)/N of the data."""
    return algbw * 2 * (ranks - 1) / ranks if ranks > 1 else algbw


def print_and_save(text, path):
    """Print a result table and, given a path (a benchmark's --out), write it there too."""
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")


def format_table(headers, rows, title=None):
    """Right-aligned plain-text table; numbers already formatted as strings by the caller."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(str(cell))) for w, cell in zip(widths, row)]
    lines = [f"# {title}"] if title else []
    lines.append("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    lines.extend("  ".join(str(c).rjust(w) for c, w in zip(row, widths)) for row in rows)
    return "\n".join(lines)


def allreduce_table(records, impl, roof_gbps=None):
    """The nccl-tests columns for one implementation's records; with roof_gbps (the machine's memcpy
    bandwidth) a last column gives busbw as a fraction of it."""
    rows = []
    for r in records:
        if r["impl"] != impl:
            continue
        row = [r["bytes"], r.get("count", "-"), r["dtype"], r["op"],
               f"{r['time_us']:.1f}", f"{r['algbw_gbps']:.3f}", f"{r['busbw_gbps']:.3f}", r["wrong"]]
        if roof_gbps:
            row.append(f"{r['busbw_gbps'] / roof_gbps:.2f}")
        rows.append(row)
    headers = ["size", "count", "dtype", "op", "time_us", "algbw", "busbw", "#wrong"]
    if roof_gbps:
        headers.append("of_memcpy")
    ranks = records[0]["ranks"] if records else "?"
    return format_table(headers, rows, title=f"{impl}  ({ranks} ranks, bandwidths in GB/s)")


def ratio_table(records, baseline, metric="busbw_gbps"):
    """metric(impl) / metric(baseline) per (dtype, size), one column per impl; time ratios invert the sense."""
    impls = [i for i in dict.fromkeys(r["impl"] for r in records) if i != baseline]
    base = {(r["dtype"], r["bytes"]): r[metric] for r in records if r["impl"] == baseline}
    by_key = {(r["impl"], r["dtype"], r["bytes"]): r[metric] for r in records}
    rows = []
    for (dtype, nbytes), ref in sorted(base.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        row = [human_bytes(nbytes), dtype]
        for impl in impls:
            value = by_key.get((impl, dtype, nbytes))
            row.append(f"{value / ref:.2f}" if value is not None and ref else "-")
        rows.append(row)
    return format_table(["size", "dtype"] + impls, rows, title=f"{metric} ratio vs {baseline}")


def machine_info():
    """What the numbers were measured on, stored next to them."""
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "host_cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
            "commit": source_commit()}


def source_commit():
    """The git commit of the checkout these scripts sit in (the code measured when PYTHONPATH points at it),
    with '+dirty' when tracked files differ from it, so a result file says what it measured."""
    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "-C", checkout, "rev-parse", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", checkout, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True)
    except OSError:                       # no git on this machine
        return "unknown"
    if head.returncode != 0:              # not a git checkout (an sdist, a copied folder)
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def write_json(path, payload):
    """Write JSON atomically enough for a benchmark (temp file then rename), creating the folder."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1, default=_json_default)
    os.replace(tmp, path)


def read_json(path):
    with open(path) as f:
        return json.load(f)


def _json_default(value):
    # numpy scalars reach us from timings; turn them into plain Python numbers
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"cannot store {type(value).__name__} in benchmark JSON")


def pyplot():
    """matplotlib with the file-only Agg backend, so benchmarks run on headless machines."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_busbw(records, path, title):
    """busbw vs message size, one line per (impl, dtype)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    series = {}
    for r in records:
        series.setdefault((r["impl"], r["dtype"]), []).append((r["bytes"], r["busbw_gbps"]))
    for (impl, dtype), points in sorted(series.items()):
        points.sort()
        style = "-" if dtype == "float32" else ("--" if dtype == "float16" else ":")
        ax.plot([p[0] for p in points], [p[1] for p in points], style, marker="o", markersize=3,
                label=f"{impl} {dtype}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def pair_summary(a, b):
    """Arms measured in pairs (a[i] and b[i] in the same moment): the per-pair ratios b / a as (median, first
    quartile, third quartile)."""
    import numpy as np
    ratios = np.asarray(b, dtype=float) / np.asarray(a, dtype=float)
    return float(np.median(ratios)), float(np.percentile(ratios, 25)), float(np.percentile(ratios, 75))


def median(values):
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def geometric_mean(values):
    values = [v for v in values if v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


# ---------------------------------------------------------------- several runs into one set of headline figures

HEADLINE_SIZES = (4096, 1 << 20, 16 << 20, 64 << 20)


def headline(runs, baseline="MPI_Allreduce", dtype="float32", sizes=HEADLINE_SIZES):
    """Median over repeated allreduce runs (lists of records) of busbw per (impl, size) and of each run's ratio
    to the baseline in that same run: ratios are only meaningful within one run on a noisy machine."""
    busbw, ratio, latency_ratio = {}, {}, {}
    for records in runs:
        base = {r["bytes"]: r for r in records if r["impl"] == baseline and r["dtype"] == dtype}
        for r in records:
            if r["dtype"] != dtype or r["bytes"] not in sizes:
                continue
            key = (r["impl"], r["bytes"])
            busbw.setdefault(key, []).append(r["busbw_gbps"])
            if r["bytes"] in base and base[r["bytes"]]["busbw_gbps"] > 0:
                ratio.setdefault(key, []).append(r["busbw_gbps"] / base[r["bytes"]]["busbw_gbps"])
                latency_ratio.setdefault(key, []).append(r["time_us"] / base[r["bytes"]]["time_us"])
    impls = list(dict.fromkeys(impl for impl, _ in busbw))
    rows = []
    for impl in impls:
        row = [impl]
        for size in sizes:
            values = busbw.get((impl, size))
            row.append("-" if not values else f"{median(values):.3g} ({median(ratio.get((impl, size), [0])):.2f}x)")
        latency = latency_ratio.get((impl, sizes[0]))
        row.append("-" if not latency else f"{median(latency):.1f}x")
        rows.append(row)
    headers = ["impl"] + [f"busbw {human_bytes(s)}" for s in sizes] + [f"time {human_bytes(sizes[0])} vs {baseline}"]
    return format_table(headers, rows, title=f"median of {len(runs)} run(s), {dtype}: busbw GB/s "
                                             f"(ratio to {baseline} in the same run)")


USAGE = """usage: python benchmarks/common.py headline RUN1.json [RUN2.json ...]
       python benchmarks/common.py plot RUN.json OUT.png IMPL[,IMPL...] TITLE"""

if __name__ == "__main__":
    import sys
    if len(sys.argv) >= 3 and sys.argv[1] == "headline":
        print(headline([read_json(path) for path in sys.argv[2:]]))
    elif len(sys.argv) == 6 and sys.argv[1] == "plot":     # a figure for the docs from a committed run
        wanted = sys.argv[4].split(",")
        plot_busbw([r for r in read_json(sys.argv[2]) if r["impl"] in wanted], sys.argv[3], sys.argv[5])
    else:
        raise SystemExit(USAGE)
