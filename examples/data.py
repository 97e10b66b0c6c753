"""The examples' data: scikit-learn's digits (ships with the package) or MNIST from IDX files, framework-free so the
torch and the Keras examples train on exactly the same rows."""
import gzip
import os
import struct

import numpy as np


def load_digits_split(test_fraction, seed):
    """sklearn's 1,797 8x8 digits, pixels scaled to [0, 1], split by a fixed permutation."""
    from sklearn.datasets import load_digits
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    n_test = int(round(len(y) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return (x[train], y[train]), (x[test], y[test])


def _open_idx(directory, stem):
    for name in (stem, stem + ".gz"):
        path = os.path.join(directory, name)
        if os.path.exists(path):
            return gzip.open(path, "rb") if name.endswith(".gz") else open(path, "rb")
    raise FileNotFoundError(f"neither {stem} nor {stem}.gz in {directory}")


def read_idx(directory, stem):
    """One IDX file (http://yann.lecun.com/exdb/mnist/): big-endian magic (dtype code, ndim), dims, raw data."""
    with _open_idx(directory, stem) as f:
        zero, dtype_code, ndim = struct.unpack(">HBB", f.read(4))
        if zero != 0 or dtype_code != 0x08:
            raise ValueError(f"{stem}: not an unsigned-byte IDX file (magic {zero:#x} {dtype_code:#x})")
        shape = struct.unpack(">" + "I" * ndim, f.read(4 * ndim))
        return np.frombuffer(f.read(), dtype=np.uint8).reshape(shape)


def load_mnist(directory):
    def images(stem):
        raw = read_idx(directory, stem)
        return (raw.reshape(len(raw), -1) / 255.0).astype(np.float32)
    return ((images("train-images-idx3-ubyte"), read_idx(directory, "train-labels-idx1-ubyte").astype(np.int64)),
            (images("t10k-images-idx3-ubyte"), read_idx(directory, "t10k-labels-idx1-ubyte").astype(np.int64)))
