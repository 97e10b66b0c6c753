"""Reduce / pack kernels' bandwidth as a fraction of the device's own copy bandwidth, measured in the same run.

    python benchmarks/gpu_kernels.py [--mib 256] [--json out.json]

Bytes are counted as memory traffic: a copy moves 2 bytes per byte (read + write), a reduce 3 (two reads and a
write), pack/unpack 2. GB/s = 1e9 bytes/s. Each figure is the median of 20 timed launches (CUDA events) after a
warm-up; `#wrong` compares the kernel's result with numpy.
"""
import argparse
import json

import numpy as np

from ringtrain import gpu
from ringtrain.ops import ReduceOp


def time_it(cp, fn, repeat=20):
    fn()
    cp.cuda.Device().synchronize()
    times = []
    for _ in range(repeat):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) * 1e-3)
    return float(np.median(times))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="buffer size in MiB")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    if not gpu.available():
        raise SystemExit("no CUDA device")
    import cupy as cp
    from ringtrain import kernels
    nbytes = args.mib << 20
    src, dst = cp.ones(nbytes, cp.uint8), cp.zeros(nbytes, cp.uint8)
    t_copy = time_it(cp, lambda: dst.data.copy_from_device_async(src.data, nbytes))
    copy_gbs = 2 * nbytes / t_copy / 1e9
    rows = [dict(kernel="cudaMemcpy D2D", dtype="uint8", bytes=nbytes, time_us=t_copy * 1e6, gbs=copy_gbs,
                 fraction=1.0, wrong=0)]
    print(f"{'kernel':<22}{'dtype':>10}{'MiB':>7}{'time_us':>11}{'GB/s':>9}{'of copy':>9}{'#wrong':>8}")
    for dtype in ("float32", "float16", "bfloat16", "float64", "int32", "int8"):
        for op in (ReduceOp.SUM, ReduceOp.AVERAGE):
            a = cp.ones(nbytes, cp.uint8).view(dtype) if dtype != "int8" else cp.ones(nbytes, cp.int8)
            b = cp.ones(nbytes, cp.uint8).view(a.dtype)
            scale = 0.5 if op == ReduceOp.AVERAGE else 1.0
            t = time_it(cp, lambda: kernels.reduce(a, b, op, scale=scale))
            check_a = cp.zeros(1 << 20, cp.float32)
            kernels.reduce(check_a, cp.ones(1 << 20, cp.float32), op, scale=scale)
            wrong = int((check_a.get() != np.float32(scale)).sum())
            gbs = 3 * nbytes / t / 1e9
            rows.append(dict(kernel=f"reduce_{op.name.lower()}", dtype=dtype, bytes=nbytes, time_us=t * 1e6, gbs=gbs,
                             fraction=gbs / copy_gbs, wrong=wrong))
    # pack 200 tensors of mixed sizes into one buffer, one launch
    sizes = np.random.default_rng(0).integers(1, 2 * (nbytes // 4) // 200, 200)
    tensors = [cp.ones(int(s), cp.float32) for s in sizes]
    buf = cp.empty(int(sizes.sum()), cp.float32)
    t = time_it(cp, lambda: kernels.pack(tensors, buf))
    wrong = int((buf.get() != 1).sum())
    gbs = 2 * buf.nbytes / t / 1e9
    rows.append(dict(kernel="pack (200 tensors)", dtype="float32", bytes=buf.nbytes, time_us=t * 1e6, gbs=gbs,
                     fraction=gbs / copy_gbs, wrong=wrong))
    launch = kernels.batched_copy_launcher(list(zip(kernels._slices(buf, tensors), tensors)))
    t = time_it(cp, launch)
    gbs = 2 * buf.nbytes / t / 1e9
    rows.append(dict(kernel="pack kernel only", dtype="float32", bytes=buf.nbytes, time_us=t * 1e6, gbs=gbs,
                     fraction=gbs / copy_gbs, wrong=0))
    t = time_it(cp, lambda: kernels.unpack(buf, tensors, scale=0.5))
    gbs = 2 * buf.nbytes / t / 1e9
    rows.append(dict(kernel="unpack x0.5 (200)", dtype="float32", bytes=buf.nbytes, time_us=t * 1e6, gbs=gbs,
                     fraction=gbs / copy_gbs, wrong=0))
    for r in rows:
        print(f"{r['kernel']:<22}{r['dtype']:>10}{r['bytes'] >> 20:>7}{r['time_us']:>11.1f}{r['gbs']:>9.0f}"
              f"{r['fraction'] * 100:>8.1f}%{r['wrong']:>8}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
