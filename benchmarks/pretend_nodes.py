"""Flat ring vs hierarchy on two pretend nodes, for allreduce, allgather, broadcast and reducescatter, in one run.

    mpiexec -n 4 python benchmarks/pretend_nodes.py [--ops allreduce,allgather,broadcast,reducescatter]
        [--min-bytes 4096] [--max-bytes 16777216] [--rounds 3] [--json out.json]

Every call goes through the public API (rt.allreduce, rt.allgather, rt.broadcast from rank 0, rt.reducescatter;
float32, Sum) with RINGTRAIN_SIMULATE_NODES=2-style pretend nodes: rt.init(simulate_nodes=2, hierarchical="0")
gives the flat mpi ring across the split, hierarchical="1" the hierarchy (transports/hierarchical.py).
Rounds are interleaved -- flat then hierarchical, then hierarchical then flat, ... -- with one init of each per
collective in every round, so both see about the same load; the ratio reported is the median over rounds of each round's flat/hierarchical time
(a paired ratio: load that changes between rounds cancels). >1 means the hierarchy is faster.
broadcast runs the same code on both sides (the hierarchy keeps MPI's Ibcast), so its ratio is the run's noise
floor: read the other ratios against it.
Size is the whole buffer, as in nccl-tests: allreduce's input, allgather's output, broadcast's array,
reducescatter's input. busbw: allreduce algbw*2(N-1)/N, allgather and reducescatter algbw*(N-1)/N, broadcast algbw.
Every size is checked against numpy (#wrong) before it is timed.
--raw times the transports alone instead (transports/hierarchical.py against the flat mpi ring, both built once on
the same pretend-node topology, no engine; the hierarchy's allgather/reducescatter at every size, its
hierarchy_min_bytes set to 0): each round then alternates the two per size, and broadcast also runs
a two-level scheme (rank 0 -> local rank 0 of every other node over MPI, then inside each node) that the
hierarchical transport does not use -- the measurement behind that choice (op broadcast-two-level).
"""
import argparse
import os
import sys

import numpy as np
from mpi4py import MPI

import common
from allreduce import PATTERN_LENGTH, count_wrong, rank_pattern, time_collective

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.append(os.path.dirname(BENCH_DIR))     # run from a source checkout without pip install

IMPLS = {"flat": "0", "hierarchical": "1"}
BUS_FACTOR = {"allreduce": lambda n: 2 * (n - 1) / n, "allgather": lambda n: (n - 1) / n,
              "reducescatter": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0,
              "broadcast-two-level": lambda n: 1.0}


def pattern(rank, count):
    return np.resize(rank_pattern(rank), count)


def op_case(rt, op, count, rank, size):
    """(run, expected result on this rank) of one collective on `count` float32 elements in all."""
    name = f"pretend.{op}.{count}"
    if op == "allreduce":
        x = pattern(rank, count)
        return (lambda: rt.allreduce(x, op=rt.Sum, name=name)), sum(pattern(r, count) for r in range(size))
    if op == "broadcast":
        x = pattern(rank, count)
        return (lambda: rt.broadcast(x, root_rank=0, name=name)), pattern(0, count)
    rows = count // size           # rows per rank: the buffer is size * rows elements
    if op == "allgather":
        x = pattern(rank, rows) + PATTERN_LENGTH * rank
        return (lambda: rt.allgather(x, name=name)), np.concatenate([pattern(r, rows) + PATTERN_LENGTH * r
                                                                     for r in range(size)])
    if op == "reducescatter":
        x = pattern(rank, rows * size)
        whole = sum(pattern(r, rows * size) for r in range(size))
        return (lambda: rt.reducescatter(x, op=rt.Sum, name=name)), whole[rank * rows: (rank + 1) * rows]
    raise ValueError(f"unknown op {op!r}; choose from {sorted(BUS_FACTOR)}")


def one_round(impl, ops, sizes, comm, args):
    """{(op, bytes): (seconds per call, #wrong)} for one init of `impl`."""
    import ringtrain as rt
    rt.init(simulate_nodes=2, hierarchical=IMPLS[impl])
    want = "mpi" if impl == "flat" else "hierarchical(shm+mpi)"
    if rt.transport_name() != want:
        raise RuntimeError(f"{impl}: expected transport {want!r}, the engine chose {rt.transport_name()!r}")
    out = {}
    try:
        for op in ops:
            for nbytes in sizes:
                count = max(comm.size, nbytes // 4) // comm.size * comm.size    # whole rows per rank
                run, expected = op_case(rt, op, count, comm.rank, comm.size)
                wrong = comm.allreduce(count_wrong(run(), expected.astype(np.float32)), op=MPI.SUM)
                seconds, _ = time_collective(run, comm, args.batch_seconds, args.repeats)
                out[(op, count * 4)] = (seconds, wrong)
    finally:
        rt.shutdown()
    return out


def raw_cases(op, count, rank, size):
    """(transport call, view holding the result, expected) on freshly filled buffers: calls work in place."""
    from ringtrain.ops import ReduceOp
    from ringtrain.transports.base import even_counts
    counts = even_counts(count, size)
    start = sum(counts[:rank])
    mine = slice(start, start + counts[rank])
    if op == "allreduce":
        buf = pattern(rank, count)
        return lambda t: t.allreduce(buf, ReduceOp.SUM), buf, sum(pattern(r, count) for r in range(size))
    if op in ("broadcast", "broadcast-two-level"):
        buf = pattern(rank, count)
        call = (lambda t: t.broadcast(buf, 0)) if op == "broadcast" else (lambda t: two_level_broadcast(t, buf))
        return call, buf, pattern(0, count)
    if op == "allgather":
        whole = np.concatenate([pattern(r, count)[:counts[r]] + PATTERN_LENGTH * r for r in range(size)])
        buf = np.zeros(count, np.float32)
        buf[mine] = whole[mine]
        return lambda t: t.allgather(buf, counts), buf, whole
    buf = pattern(rank, count)
    return (lambda t: t.reducescatter(buf, counts, ReduceOp.SUM), buf[mine],
            sum(pattern(r, count) for r in range(size))[mine])


def two_level_broadcast(transport, buf):
    """A two-level broadcast from rank 0, measured here and not used by the transport:
    rank 0 sends to local rank 0 of every other node over MPI (that pair is the hierarchy's block-0 ring), then
    every node broadcasts inside. On the flat ring it is the flat broadcast."""
    if not hasattr(transport, "intra"):
        transport.broadcast(buf, 0)
        return
    column = dict(transport.cross).get(0)        # we own block 0: local rank 0 of our node
    if column is not None and column.size > 1:
        column.broadcast(buf, 0)
    transport.intra.broadcast(buf, 0)


def raw_rounds(ops, sizes, comm, args):
    """[{impl: {(op, bytes): (seconds per call, #wrong)}}] per round, the transports alone, alternating per size."""
    from ringtrain.config import Config
    from ringtrain.topology import Topology
    from ringtrain.transports.hierarchical import HierarchicalTransport
    from ringtrain.transports.mpi import MPITransport
    from ringtrain.engine.watchdog import Watchdog
    topology = Topology(comm, simulate_nodes=2)
    transports = {"hierarchical": HierarchicalTransport(topology, Config(), Watchdog()),
                  "flat": MPITransport(comm.Dup(), Config(), Watchdog())}
    transports["hierarchical"].hierarchy_min_bytes = 0      # the hierarchy at every size: what set the threshold
    rounds = [{impl: {} for impl in IMPLS} for _ in range(args.rounds)]
    for r, results in enumerate(rounds):
        for op in ops:
            for nbytes in sizes:
                count = max(comm.size, nbytes // 4) // comm.size * comm.size
                for impl in (list(IMPLS) if r % 2 == 0 else list(IMPLS)[::-1]):
                    call, result, expected = raw_cases(op, count, comm.rank, comm.size)
                    call(transports[impl])
                    wrong = comm.allreduce(count_wrong(result, expected.astype(np.float32)), op=MPI.SUM)
                    seconds, _ = time_collective(lambda: call(transports[impl]), comm, args.batch_seconds,
                                                 args.repeats)
                    results[impl][(op, count * 4)] = (seconds, wrong)
    for t in transports.values():
        t.close()
    topology.free()
    return rounds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ops", default="allreduce,allgather,broadcast,reducescatter")
    parser.add_argument("--min-bytes", type=int, default=4096)
    parser.add_argument("--max-bytes", type=int, default=16 << 20)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved init rounds of each implementation")
    parser.add_argument("--repeats", type=int, default=5, help="timed batches per size and round (median)")
    parser.add_argument("--batch-seconds", type=float, default=0.02)
    parser.add_argument("--raw", action="store_true", help="the transports alone, no engine (see the docstring)")
    parser.add_argument("--json", help="write the records here")
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    if comm.size < 2:
        raise SystemExit("two pretend nodes need at least two ranks")
    ops = args.ops.split(",")
    sizes = common.size_ladder(args.min_bytes, args.max_bytes, 4)
    if args.raw:
        rounds = raw_rounds(ops, sizes, comm, args)
    else:
        rounds = []
        for r in range(args.rounds):       # per collective, so flat and hierarchical run seconds apart
            order = list(IMPLS) if r % 2 == 0 else list(IMPLS)[::-1]
            results = {impl: {} for impl in IMPLS}
            for op in ops:
                for impl in order:
                    results[impl].update(one_round(impl, [op], sizes, comm, args))
            rounds.append(results)
    if comm.rank:
        return 0
    records, rows = [], []
    n = comm.size
    for op in ops:
        for key in sorted(rounds[0]["flat"]):
            if key[0] != op:
                continue
            nbytes = key[1]
            ratios = [rnd["flat"][key][0] / rnd["hierarchical"][key][0] for rnd in rounds]
            row = [op, common.human_bytes(nbytes)]
            for impl in IMPLS:
                seconds = float(np.median([rnd[impl][key][0] for rnd in rounds]))
                wrong = sum(rnd[impl][key][1] for rnd in rounds)
                algbw = nbytes / seconds / 1e9
                records.append({"impl": f"ringtrain-2nodes-{impl}" + ("-raw" if args.raw else ""), "collective": op, "ranks": n, "bytes": nbytes,
                                "dtype": "float32", "op": "sum", "time_us": seconds * 1e6, "algbw_gbps": algbw,
                                "busbw_gbps": algbw * BUS_FACTOR[op](n), "wrong": wrong,
                                "round_time_us": [rnd[impl][key][0] * 1e6 for rnd in rounds]})
                row += [f"{seconds * 1e6:.1f}", f"{algbw * BUS_FACTOR[op](n):.3f}", wrong]
            row += [f"{float(np.median(ratios)):.2f}", " ".join(f"{x:.2f}" for x in ratios)]
            rows.append(row)
    layout = "+".join(str(n // 2 + (1 if i < n % 2 else 0)) for i in range(2))
    print(common.format_table(
        ["collective", "size", "flat_us", "flat_busbw", "#wrong", "hier_us", "hier_busbw", "#wrong",
         "hier/flat", "per round"], rows,
        title=f"{n} ranks as {layout} pretend nodes, {'transports alone' if args.raw else 'through the API'}, {os.cpu_count()} cores, float32, commit {common.source_commit()}"
              f"; medians over {args.rounds} interleaved rounds; hier/flat = median of per-round busbw ratios"))
    total_wrong = sum(r["wrong"] for r in records)
    print(f"\n# total #wrong: {total_wrong}")
    if args.json:
        stamp = common.machine_info()
        for r in records:
            r.update(date=stamp["date"], cores=stamp["cores"], commit=stamp["commit"])
        common.write_json(args.json, records)
    return 1 if total_wrong else 0


if __name__ == "__main__":
    sys.exit(main())
