"""How big the chunks should be in which the shm transport passes a PRIVATE buffer through its shared region.

    mpiexec -n 2 python benchmarks/shm_chunk_sweep.py --out benchmarks/results/shm_chunk_sweep.txt

One transport, one allreduce_out(src, dst) of private float32 arrays per size; every repetition runs MPI_Allreduce and
each chunk setting back to back (interleaved, so a noisy neighbour slows them alike). Prints median ms per call and
each setting's time relative to the largest setting (one chunk: the behaviour before chunking). Results are checked
against MPI_Allreduce's.
"""
import argparse
import sys
import time

import numpy as np
from mpi4py import MPI

from common import format_table, machine_info, print_and_save, source_commit
from ringtrain.config import Config
from ringtrain.ops import ReduceOp
from ringtrain.transports.shm import SharedMemoryTransport
from ringtrain.engine.watchdog import Watchdog


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", default="8,16,32,64")
    parser.add_argument("--chunks-mb", default="2,4,8,128", help="the largest is taken as 'one chunk'")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    chunks = [int(c) << 20 for c in args.chunks_mb.split(",")]
    config = Config(fusion_threshold=max(chunks), shared_pool_bytes=0)
    transport = SharedMemoryTransport(comm.Dup(), config, Watchdog())
    rows = []
    for mb in [int(s) for s in args.sizes_mb.split(",")]:
        src = np.random.default_rng(comm.rank).random((mb << 20) // 4, dtype=np.float32)
        dst, want = np.zeros_like(src), np.zeros_like(src)
        times = {name: [] for name in ["MPI_Allreduce"] + chunks}
        for _ in range(args.reps):
            for name in times:
                comm.Barrier()
                start = time.perf_counter()
                if name == "MPI_Allreduce":
                    comm.Allreduce(src, want)
                else:
                    transport.private_chunk_bytes = name
                    transport.allreduce_out(src, dst, ReduceOp.SUM)
                times[name].append(time.perf_counter() - start)
            if not np.allclose(dst, want, rtol=1e-5):
                sys.exit(f"rank {comm.rank}: wrong result at {mb} MB")
        ms = {name: float(np.median(t)) * 1e3 for name, t in times.items()}
        rows.append([f"{mb} MB", f"{ms['MPI_Allreduce']:.2f}"] +
                    [f"{ms[c]:.2f} ({ms[c] / ms[max(chunks)]:.2f})" for c in chunks])
    transport.close()
    if comm.rank == 0:
        headers = ["size", "MPI ms"] + [f"{c >> 20} MB chunks ms (vs one)" for c in chunks]
        info = machine_info()
        text = "\n".join([f"# {comm.size} ranks, {info['date']}, {info['cores']} cores {info['host_cpu']}, "
                          f"commit {source_commit()}",
                          format_table(headers, rows, title="shm allreduce_out of private float32, median ms")])
        print_and_save(text, args.out)


if __name__ == "__main__":
    main()
