"""The long soak of the engine: correctness under churn at scale, with throughput and memory.

    mpiexec -n 4 python benchmarks/soak.py --mode program --ops 10000 [--transport mpi] [--simulate-nodes 2]
    mpiexec -n 4 python benchmarks/soak.py --mode issue                 # the two loops that once broke the engine
    mpiexec -n 4 python benchmarks/soak.py --mode names --names 100000  # distinct names, RSS must stay flat

program: tests/soak.py's randomized differential programs (every kind and grouped form, op, dtype, sizes past every
         eager and chunk limit, sync and async in rank-dependent order, set ops, in-window arrays), a cache capacity
         of 32 so names churn past it; every result checked against numpy.
issue:   the allgather loop (1,400 batches of 4 allgathers, a new name each, 1..3 rows by rank) and the random
         async mix (1,000 batches of allreduce / allgather / broadcast, 4 dtypes, 1..70,000 elements, a new name
         per op), at the default cache capacity.
names:   batches of 4 async collectives (allreduce, allgather with rank-dependent rows, broadcast, allreduce), each
         under a name never used before, until --names names; RSS after a warm-up of --warmup names and at the end.

Rank 0 prints one line per run: `soak[<mode>]: ranks=N ops=<per rank> wrong=W seconds=S ops/s=R rss_start_mb=..
rss_warm_mb=.. rss_end_mb=.. growth_mb=..` (RSS of rank 0; the largest growth over the ranks), and with --json
appends a record to that file. Exit status 1 when anything was wrong.
"""
import argparse
import json
import os
import sys
import time

import numpy as np
from mpi4py import MPI

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))
import soak  # noqa: E402  (tests/soak.py: programs, references and the issue's workloads)

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE / 2**20


def distinct_names(rt, count, prefix="names"):
    """Batches of four collectives, every one under a new name; returns (ops, wrong)."""
    rank, size = rt.rank(), rt.size()
    total = size * (size + 1) // 2
    rows = np.concatenate([np.full((1 + q % 3, 2), q, np.float32) for q in range(size)])
    wrong = ops = 0
    for b in range(count // 4):
        base = f"{prefix}.{b}"
        handles = [rt.allreduce_async(np.full(3, rank + 1.0, np.float32), op=rt.Sum, name=base + ".a"),
                   rt.allgather_async(np.full((1 + rank % 3, 2), rank, np.float32), name=base + ".g"),
                   rt.broadcast_async(np.full(5, float(rank)), root_rank=b % size, name=base + ".b"),
                   rt.allreduce_async(np.full(2, rank + 1, np.int32), op=rt.Sum, name=base + ".i")]
        got = [h.wait() for h in handles]
        wrong += (not np.array_equal(got[0], np.full(3, total, np.float32))) + (not np.array_equal(got[1], rows)) \
            + (not np.array_equal(got[2], np.full(5, float(b % size)))) \
            + (not np.array_equal(got[3], np.full(2, total, np.int32)))
        ops += 4
    return ops, wrong


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("program", "issue", "names"), default="program")
    parser.add_argument("--ops", type=int, default=10000, help="program mode: ops per rank to draw")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--names", type=int, default=100000, help="names mode: distinct names")
    parser.add_argument("--warmup", type=int, default=8000, help="names mode: names before the RSS baseline")
    parser.add_argument("--loop-batches", type=int, default=1400)
    parser.add_argument("--mix-batches", type=int, default=1000)
    parser.add_argument("--transport", default=None)
    parser.add_argument("--simulate-nodes", type=int, default=0)
    parser.add_argument("--cache-capacity", type=int, default=None,
                        help="default: 32 in program mode (churn), the engine's default otherwise")
    parser.add_argument("--json", default=None, help="append one JSON record per run to this file")
    args = parser.parse_args(argv)

    import ringtrain as rt
    config = dict(simulate_nodes=args.simulate_nodes)
    if args.mode == "program":
        config.update(soak.SOAK_CONFIG)
    if args.cache_capacity is not None:
        config["cache_capacity"] = args.cache_capacity
    if args.transport:
        config["transport"] = args.transport
    rss_start = rss_mb()
    rt.init(**config)
    rank, size = rt.rank(), rt.size()
    messages = []
    log = (lambda msg: messages.append(msg) if len(messages) < 20 else None)
    rss_warm = None
    start = time.perf_counter()
    if args.mode == "program":
        ops, wrong = soak.run_soak(rt, args.seed, args.ops, log=log)
    elif args.mode == "issue":
        ops, wrong = soak.allgather_loop(rt, args.loop_batches, prefix=f"loop{args.seed}")
        more, bad = soak.random_mix(rt, args.mix_batches, seed=args.seed, prefix=f"mix{args.seed}")
        ops, wrong = ops + more, wrong + bad
    else:
        ops, wrong = distinct_names(rt, args.warmup, prefix="warm")
        rss_warm = rss_mb()
        start = time.perf_counter()
        more, bad = distinct_names(rt, args.names)
        ops, wrong = more, wrong + bad
    seconds = time.perf_counter() - start
    rss_end = rss_mb()
    growth = rss_end - (rss_warm if rss_warm is not None else rss_start)
    world = MPI.COMM_WORLD
    all_wrong = world.allreduce(wrong, op=MPI.SUM)
    max_growth = world.allreduce(growth, op=MPI.MAX)
    cache = len(rt.core.state.engine().agreement.cache)
    for msg in messages:
        print(msg, file=sys.stderr, flush=True)
    transport = rt.transport_name()
    rt.shutdown()
    if rank == 0:
        record = {"mode": args.mode, "ranks": size, "transport": transport, "simulate_nodes": args.simulate_nodes,
                  "seed": args.seed, "ops_per_rank": ops, "wrong": all_wrong, "seconds": round(seconds, 2),
                  "ops_per_s": round(ops / seconds, 1), "rss_start_mb": round(rss_start, 1),
                  "rss_warm_mb": None if rss_warm is None else round(rss_warm, 1), "rss_end_mb": round(rss_end, 1),
                  "max_growth_mb": round(max_growth, 2), "cache_entries": cache}
        print(f"soak[{args.mode}]: " + " ".join(f"{k}={v}" for k, v in record.items() if k != "mode"), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(record) + "\n")
    return 0 if all_wrong == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
