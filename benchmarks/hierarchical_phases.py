"""Where a hierarchical allreduce spends its time on pretend nodes, beside the flat ring and a plain memory copy.

    mpiexec -n 4 python benchmarks/hierarchical_phases.py [--mb 16] [--repeats 10] [--json out.json]

Runs the host transports alone (no engine) on RINGTRAIN_SIMULATE_NODES-style pretend nodes (two by default):
`allreduce_out(src, dst)` of the flat mpi ring and of the hierarchical transport, and the hierarchical one's three
steps timed apart (intra-node reduce-scatter, cross-node rings, intra-node allgather), each in wall time and in this
process's CPU time. Also a same-size exchange with the rank on the other pretend node (MPI_Sendrecv) against a numpy
copy of the same bytes: when MPI between pretend nodes costs what a memory copy costs, as on one machine, the
hierarchy can only win by moving fewer bytes through memory, not by keeping them off a network.
Every result is checked against MPI_Allreduce; medians over ranks and repeats are printed by rank 0.
"""
import argparse
import json
import os
import sys
import time

import numpy as np
from mpi4py import MPI

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.append(os.path.dirname(BENCH_DIR))     # run from a source checkout without pip install

from ringtrain.config import Config                                    # noqa: E402
from ringtrain.ops import ReduceOp                                     # noqa: E402
from ringtrain.topology import Topology                                # noqa: E402
from ringtrain.transports.hierarchical import HierarchicalTransport    # noqa: E402
from ringtrain.transports.mpi import MPITransport                      # noqa: E402
from ringtrain.engine.watchdog import Watchdog                                # noqa: E402


class Stopwatch:
    """Wall and CPU seconds per named step, summed over the steps of one call."""

    def __init__(self):
        self.calls, self.current, self.running = [], {}, set()

    def wrap(self, obj, method, step):
        inner = getattr(obj, method)

        def timed(*args, **kwargs):
            if step in self.running:          # Transport.allreduce calls reducescatter and allgather: count once
                return inner(*args, **kwargs)
            self.running.add(step)
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                return inner(*args, **kwargs)
            finally:
                w, c = self.current.get(step, (0.0, 0.0))
                self.current[step] = (w + time.perf_counter() - wall, c + time.process_time() - cpu)
                self.running.discard(step)
        setattr(obj, method, timed)

    def next_call(self):
        self.calls.append(self.current)
        self.current = {}


def timed(comm, fn, repeats):
    """[(wall s, cpu s)] per call after one warm-up; ranks start each call together."""
    out = []
    for i in range(repeats + 1):
        comm.Barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        if i:
            out.append((time.perf_counter() - wall, time.process_time() - cpu))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=16, help="allreduce size in MB (float32)")
    parser.add_argument("--nodes", type=int, default=2, help="pretend nodes")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", help="write the medians here")
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    count = int(args.mb * (1 << 20)) // 4
    topology = Topology(comm, simulate_nodes=args.nodes)
    hierarchical = HierarchicalTransport(topology, Config(), Watchdog())
    flat = MPITransport(comm.Dup(), Config(), Watchdog())
    src = np.random.default_rng(comm.rank).integers(-3, 4, count).astype(np.float32)
    dst = np.empty_like(src)
    want = np.empty_like(src)
    comm.Allreduce(src, want)

    watch = Stopwatch()
    watch.wrap(hierarchical.intra, "reducescatter_out", "intra reduce-scatter")
    for _, transport in hierarchical.cross:
        for method in ("allreduce", "reducescatter", "allgather"):
            watch.wrap(transport, method, "cross-node rings")
    watch.wrap(hierarchical.intra, "allgather", "intra allgather")

    rows, wrong = {}, 0
    for name, transport in (("flat mpi ring", flat), ("hierarchical", hierarchical)):
        def call(transport=transport):
            transport.allreduce_out(src, dst, ReduceOp.SUM)
            if transport is hierarchical:
                watch.next_call()
        rows[f"{name} allreduce_out"] = timed(comm, call, args.repeats)
        wrong += int(np.count_nonzero(dst != want))
    for step in watch.calls[0]:
        rows[f"  hierarchical: {step}"] = [c[step] for c in watch.calls[1:]]
    other = topology.nodes[(topology.node_index + 1) % topology.num_nodes]
    peer = other[min(topology.local_rank, len(other) - 1)]
    half = src[: count // (hierarchical.num_blocks * topology.num_nodes)]    # one exchange of a cross-node ring
    landing = np.empty_like(half)
    pairs = comm.allgather(peer)
    if all(pairs[p] == r for r, p in enumerate(pairs)):     # a clean pairing (even layouts)
        rows[f"MPI_Sendrecv {half.nbytes / 2**20:g} MB with the other node"] = timed(
            comm, lambda: comm.Sendrecv(half, peer, 7, landing, peer, 7), args.repeats)
    rows[f"numpy copy {half.nbytes / 2**20:g} MB"] = timed(comm, lambda: np.copyto(landing, half), args.repeats)

    everything = comm.gather(rows)
    wrong = comm.allreduce(wrong)
    hierarchical.close()
    flat.close()
    topology.free()
    if comm.rank:
        return 0
    layout = "+".join(str(len(node)) for node in topology.nodes)
    print(f"# {comm.size} ranks as {layout} pretend nodes, {os.cpu_count()} cores, float32 {args.mb:g} MB, "
          f"transports alone (no engine), median over ranks x {args.repeats} calls; #wrong {wrong}")
    print(f"{'':52s} {'wall ms':>8s} {'cpu ms':>8s}")
    medians = {}
    for name in rows:
        samples = np.array([s for r in everything for s in r[name]])
        medians[name] = {"wall_ms": float(np.median(samples[:, 0]) * 1e3), "cpu_ms": float(np.median(samples[:, 1]) * 1e3)}
        print(f"{name:52s} {medians[name]['wall_ms']:8.2f} {medians[name]['cpu_ms']:8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": comm.size, "layout": layout, "mb": args.mb, "wrong": wrong, "rows": medians}, f,
                      indent=1)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
