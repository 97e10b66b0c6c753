"""Would one result buffer shared by the ranks pay, against each rank's own result? A prototype at the transport
level for a gradient bucket after backward: fresh private gradients reduced into a bucket of the shm window (a
refilled bucket), or gradients that already lie in the window (a bucket whose gradients are views of it).

    mpiexec -n 2 python benchmarks/shm_shared_result.py --out benchmarks/results/shm_shared_result.txt

Arms, per size and repetition back to back in alternating order, each followed by an SGD-with-momentum update that
reads the result (as the optimizer would read .grad):
  own            allreduce_out(src, dst): dst this rank's bucket; the blocks peers read are copied into it, each
                 rank reduces its block and pushes it into every rank's bucket (in one piece)
  shared         each rank copies the blocks peers read into its region, reduces its block into ONE buffer (rank
                 0's) and pushes nothing; every rank's update reads that buffer. Per rank that saves the push (half
                 the data written), but every rank's optimizer then reads memory that half of is written by the
                 other core, as with own. Not race-free as a .grad (see the docs): a prototype only.
  views-own      the gradients lie in this rank's bucket in the window (views): allreduce in place, each rank
                 reads its block from every peer's bucket and pushes its result into every peer's bucket
  views-shared   the gradients lie in the window: each rank reads its block from every rank's bucket where it lies
                 and writes it once, into ONE buffer (rank 0's); no copy-in and no push at all
Prints the median ms (slowest rank) of the reduction and of reduction + update, and each arm / own (views arms:
/ views-own).
"""
import argparse
import os
import sys
import time

import numpy as np
import torch
from mpi4py import MPI

from common import format_table, machine_info, print_and_save, source_commit
from ringtrain.config import Config
from ringtrain.ops import ReduceOp
from ringtrain.transports.base import even_counts, offsets
from ringtrain.transports.shm import SharedMemoryTransport
from ringtrain.engine.watchdog import Watchdog

ARMS = ("own", "shared", "views-own", "views-shared")


def _average_block(t, inputs, result, start, count):
    """result[start: start + count] = the mean of the inputs there, in cache-sized pieces (the sum and the scale
    while each piece is in cache, as the transport's own reduce)."""
    piece = t.cache_piece_bytes // result.itemsize
    for lo in range(start, start + count, piece):
        hi = min(lo + piece, start + count)
        acc = result[lo:hi]
        np.add(inputs[0][lo:hi], inputs[1][lo:hi], out=acc)
        for other in inputs[2:]:
            np.add(acc, other[lo:hi], out=acc)
        acc *= 1.0 / len(inputs)


def shared_allreduce(t, src, result, counts):
    """src summed over the ranks and divided by their number, into `result`, a buffer every rank can address."""
    r, n, starts = t.rank, t.size, offsets(counts)
    stage = t._data[r][:src.nbytes].view(src.dtype)
    for q in range(n):
        if q != r:
            stage[starts[q]: starts[q] + counts[q]] = src[starts[q]: starts[q] + counts[q]]
    t._barrier("ready")
    peers = [t._data[q][:src.nbytes].view(src.dtype) for q in range(n) if q != r]
    _average_block(t, [src] + peers, result, starts[r], counts[r])
    t._barrier("done")


def shared_allreduce_in_place(t, bucket, result, counts):
    """Every rank's `bucket` (the same offset in every region) summed and divided by the ranks' number, into
    `result`: rank r reads block r of every rank's bucket where it lies and writes it once."""
    r, n, starts = t.rank, t.size, offsets(counts)
    begin = t._start(bucket)
    t._barrier("ready")
    buckets = [t._data[(r + i) % n][begin: begin + bucket.nbytes].view(bucket.dtype) for i in range(n)]
    _average_block(t, buckets, result, starts[r], counts[r])
    t._barrier("done")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", default="7.9,25.4,31.5")
    parser.add_argument("--reps", type=int, default=25)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    load_before = os.getloadavg()[0]
    t = SharedMemoryTransport(comm.Dup(), Config(), Watchdog())
    rows = []
    for mb in [float(s) for s in args.sizes_mb.split(",")]:
        count = int(mb * (1 << 20)) // 4
        src = np.empty(count, dtype=np.float32)
        own = t.shared_array(count * 4).view(np.float32)
        mine = t.shared_array(count * 4)          # at the same offset on every rank: rank 0's is THE result
        start = t._start(mine)
        shared = t._data[0][start: start + count * 4].view(np.float32)
        views = t.shared_array(count * 4).view(np.float32)    # this rank's bucket, its gradients lie in it
        param, momentum = torch.zeros(count), torch.zeros(count)
        reduce_s = {arm: [] for arm in ARMS}
        step_s = {arm: [] for arm in ARMS}
        for rep in range(args.reps):
            for arm in (ARMS if rep % 2 == 0 else ARMS[::-1]):
                comm.Barrier()
                (views if arm.startswith("views") else src).fill(comm.rank + 1.0)
                begin = time.perf_counter()
                if arm == "shared":
                    shared_allreduce(t, src, shared, even_counts(count, comm.size))
                    result = shared
                elif arm == "views-shared":
                    shared_allreduce_in_place(t, views, shared, even_counts(count, comm.size))
                    result = shared
                elif arm == "views-own":
                    t.allreduce_out(views, views, ReduceOp.SUM, 1.0 / comm.size)
                    result = views
                else:
                    t.allreduce_out(src, own, ReduceOp.SUM, 1.0 / comm.size)
                    result = own
                reduced = time.perf_counter()
                momentum.mul_(0.9).add_(torch.from_numpy(result))
                param.add_(momentum, alpha=-0.01)
                reduce_s[arm].append(reduced - begin)
                step_s[arm].append(time.perf_counter() - begin)
                if rep == 0 and not np.all(result == (comm.size + 1) / 2):
                    sys.exit(f"rank {comm.rank}: wrong result at {mb} MB, {arm}")
        ms = comm.gather({arm: (float(np.median(reduce_s[arm])) * 1e3, float(np.median(step_s[arm])) * 1e3)
                          for arm in ARMS})
        if comm.rank == 0:
            worst = {arm: [max(m[arm][i] for m in ms) for i in (0, 1)] for arm in ARMS}
            base = {arm: "views-own" if arm.startswith("views") else "own" for arm in ARMS}
            rows.append([f"{mb:g} MB"] + [f"{worst[arm][i]:.2f} ({worst[arm][i] / worst[base[arm]][i]:.3f})"
                                          for i in (0, 1) for arm in ARMS])
    if comm.rank == 0:
        headers = ["size"] + [f"{what} {arm}" for what in ("reduce", "+ SGD") for arm in ARMS]
        info = machine_info()
        text = "\n".join([f"# {comm.size} ranks, {info['date']}, {info['cores']} cores {info['host_cpu']}, "
                          f"commit {source_commit()}, load {load_before:.2f} -> {os.getloadavg()[0]:.2f}",
                          format_table(headers, rows, title="float32 gradients reduced into the shm window, median ms "
                                                            "of the slowest rank (x own; views arms x views-own)")])
        print_and_save(text, args.out)
    t.close()


if __name__ == "__main__":
    main()
