"""How ringtrain.tensorflow moves tensors to numpy and back, and what the copies it avoids would cost.

    python benchmarks/tf_zero_copy.py [--json out.json]

For each size: median time of tensor.numpy() (TF's public call; it copies) vs arrays.to_array (np.from_dlpack: a
view), and tf.constant(array) (copies) vs arrays.to_tensor (DLPack wrap of a 64-byte-aligned array), plus whether
each result shares memory with its source (the check that makes the numbers mean something).
"""
import argparse
import os
import sys
import time

import common

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIZES = (4 << 10, 1 << 20, 16 << 20)


def median_us(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * common.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf

    from ringtrain.tensorflow import arrays
    records, rows = [], []
    for nbytes in SIZES:
        tensor = tf.random.normal([nbytes // 4])
        view = arrays.to_array(tensor)
        aligned = arrays.aligned_empty(nbytes // 4, np.float32)
        aligned[...] = 1.0
        wrapped = arrays.to_tensor(aligned)
        aligned[0] = 7.0
        record = {"bytes": nbytes,
                  "tensor_numpy_us": median_us(lambda: tensor.numpy(), args.repeats),
                  "to_array_us": median_us(lambda: arrays.to_array(tensor), args.repeats),
                  "tf_constant_us": median_us(lambda: tf.constant(aligned), args.repeats),
                  "to_tensor_us": median_us(lambda: arrays.to_tensor(aligned), args.repeats),
                  "to_array_shares_memory": bool(np.shares_memory(view, arrays.to_array(tensor))),
                  "to_tensor_shares_memory": float(wrapped[0]) == 7.0,
                  "numpy_shares_memory": bool(np.shares_memory(tensor.numpy(), tensor.numpy()))}
        records.append(record)
        rows.append([common.human_bytes(nbytes), f"{record['tensor_numpy_us']:.1f}", f"{record['to_array_us']:.1f}",
                     f"{record['tf_constant_us']:.1f}", f"{record['to_tensor_us']:.1f}",
                     f"{record['numpy_shares_memory']}/{record['to_array_shares_memory']}/"
                     f"{record['to_tensor_shares_memory']}"])
    print(common.format_table(["size", "t.numpy() us", "to_array us", "tf.constant us", "to_tensor us",
                               "shares: numpy/to_array/to_tensor"], rows,
                              title=f"tf <-> numpy on CPU, TensorFlow {tf.__version__}, median of {args.repeats}"))
    if args.json:
        common.write_json(args.json, {"machine": common.machine_info(), "records": records})


if __name__ == "__main__":
    main()
