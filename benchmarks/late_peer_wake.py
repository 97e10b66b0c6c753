"""How soon does an allreduce return once the late rank arrives? Rank 1 arrives `delay` after rank 0 (a busy
loop: it computes meanwhile); both record when they called and when the call returned (perf_counter is
CLOCK_MONOTONIC, one clock for every process on the machine). wake_us = rank 0's return minus rank 1's call: what
the call costs beyond the wait for the late rank. Split by how Engine.express answered on rank 0 (done in its
cycle; a handle: the cycle went on without the late rank and the general path waits), with MPI_Allreduce of the
same scalar, same delays, interleaved, in the same job.

    mpiexec -n 2 python benchmarks/late_peer_wake.py --rounds 3 --out late_peer_wake.txt
"""
import argparse
import collections
import os
import sys
import time

import numpy as np
from mpi4py import MPI

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)

from common import format_table, machine_info, print_and_save, source_commit  # noqa: E402

import ringtrain as rt  # noqa: E402
from ringtrain.core import state  # noqa: E402

DELAYS_MS = (0.0, 0.1, 0.3, 1.0, 2.0, 4.0, 8.0)


def spin_until(t):
    while time.perf_counter() < t:
        pass


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=30, help="calls per delay, arm and round")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    rt.init()
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    engine = state.engine()
    outcomes = []
    real = engine.express

    def spy(*a, **k):
        outcome = real(*a, **k)
        outcomes.append("done" if outcome is True else "none" if outcome is None else "handle")
        return outcome
    engine.express = spy
    x = np.ones(1, np.float32)
    out = np.empty(1, np.float32)
    for _ in range(20):                       # warm: the name is known, the memo holds its plan
        rt.allreduce(x, name="m")
    rows = []                                  # (arm, delay, t_call, t_return, outcome)
    rng = np.random.default_rng(1)
    for _ in range(args.rounds):
        for delay in DELAYS_MS:
            for arm in ("ringtrain", "mpi"):
                for _ in range(args.calls):
                    comm.Barrier()
                    jitter = rng.random() * 0.2e-3          # the same draw on both ranks: same seed
                    t0 = time.perf_counter() + 50e-6
                    spin_until(t0 + (delay * 1e-3 + jitter if rank == 1 else 0.0))
                    before = len(outcomes)
                    t_call = time.perf_counter()
                    if arm == "ringtrain":
                        rt.allreduce(x, name="m")
                    else:
                        comm.Allreduce(x, out)
                    t_ret = time.perf_counter()
                    outcome = outcomes[-1] if arm == "ringtrain" and len(outcomes) > before else "-"
                    rows.append((arm, delay, t_call, t_ret, outcome))
    every = comm.gather(rows, root=0)
    load = os.getloadavg()[0]
    if rank == 0:
        groups = collections.defaultdict(list)
        for r0, r1 in zip(every[0], every[1]):
            arm, delay, _, t_ret0, outcome = r0
            wake = (t_ret0 - max(r0[2], r1[2])) * 1e6
            groups[(delay, arm if arm == "mpi" else f"ringtrain:{outcome}")].append(wake)
            groups[("all", arm if arm == "mpi" else f"ringtrain:{outcome}")].append(wake)
        table = [[str(d), a, len(v), f"{np.median(v):.1f}", f"{np.percentile(v, 90):.1f}"]
                 for (d, a), v in sorted(groups.items(), key=lambda kv: (str(kv[0][0]), kv[0][1]))]
        text = (f"# late_peer_wake: {machine_info()} commit {source_commit()} load {load:.2f}\n"
                + format_table(["delay_ms", "arm:express outcome", "calls", "wake_us median", "p90"], table))
        print_and_save(text, args.out)
    rt.shutdown()


if __name__ == "__main__":
    main()
