"""GPU allreduce busbw per device transport (cuda_ipc, mpi_staged, nccl ring, ncclAllReduce), nccl-tests style.

    mpiexec -n 2 python benchmarks/gpu_allreduce.py --transports cuda_ipc,mpi_staged
    python benchmarks/gpu_allreduce.py --transports nccl,nccl_allreduce          # 1 rank: ring vs ncclAllReduce

float32 sum in the transport's staging buffer (what the engine reduces after packing). time_us is the slowest
rank's median over 10 iterations after 2 warm-ups; busbw = algbw * 2(N-1)/N. #wrong counts elements != the sum.
"""
import argparse
import time

import numpy as np
from mpi4py import MPI

from ringtrain import gpu
from ringtrain.config import Config
from ringtrain.ops import ReduceOp
from ringtrain.engine.watchdog import Watchdog


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transports", default="cuda_ipc,mpi_staged")
    parser.add_argument("--sizes", default="4K,1M,16M,64M,256M")
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    if not gpu.available():
        raise SystemExit("no CUDA device")
    gpu.bind(comm.rank)
    import cupy as cp
    from ringtrain.transports import transport_class
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    sizes = [int(s[:-1]) * units[s[-1]] if s[-1] in units else int(s) for s in args.sizes.split(",")]
    n = comm.size
    if comm.rank == 0:
        print(f"# {n} rank(s), one GPU each or shared: {cp.cuda.runtime.getDeviceProperties(gpu.bound_device())['name'].decode()}")
        print(f"{'transport':<16}{'size':>12}{'count':>12}{'dtype':>8}{'op':>5}{'time_us':>11}{'algbw':>9}{'busbw':>9}{'#wrong':>8}")
    for name in args.transports.split(","):
        t = transport_class(name)(comm.Dup(), Config.from_env(), Watchdog())
        for nbytes in sizes:
            count = nbytes // 4
            buf = t.staging_buffer(count * 4).view(cp.float32)
            times = []
            for i in range(args.iters + 2):
                buf.fill(comm.rank + 1)
                cp.cuda.Device().synchronize()
                comm.Barrier()
                start = time.perf_counter()
                t.allreduce(buf, ReduceOp.SUM)
                gpu.comm_stream().synchronize()
                if i >= 2:
                    times.append(time.perf_counter() - start)
            wrong = int((buf != n * (n + 1) / 2).sum())
            elapsed = comm.allreduce(float(np.median(times)), op=MPI.MAX)
            wrong = comm.allreduce(wrong, op=MPI.SUM)
            algbw = nbytes / elapsed / 1e9
            if comm.rank == 0:
                print(f"{name:<16}{nbytes:>12}{count:>12}{'float32':>8}{'sum':>5}{elapsed * 1e6:>11.1f}"
                      f"{algbw:>9.2f}{algbw * 2 * (n - 1) / n:>9.2f}{wrong:>8}", flush=True)
        t.close()


if __name__ == "__main__":
    main()
