"""The examples' data: scikit-learn's digits (ships with the package) or MNIST from IDX files, framework-free so the
torch and the Keras examples train on exactly the same rows."""
import gzip
import importlib.util
import os
import struct

import numpy as np


def load_digits():
    """sklearn's 1,797 8x8 digits as (pixels scaled to [0, 1] float32 (1797, 64), labels int64): the CSV file that
    scikit-learn ships, read as sklearn.datasets.load_digits reads it, without importing sklearn.datasets (that
    import pulls in scipy.stats: seconds per process, paid by every rank and every worker that joins)."""
    spec = importlib.util.find_spec("sklearn")       # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the digits data set comes with scikit-learn: pip install scikit-learn")
    path = os.path.join(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")
    with gzip.open(path, "rt") as f:
        data = np.loadtxt(f, delimiter=",")
    return (data[:, :-1] / 16.0).astype(np.float32), data[:, -1].astype(np.int64)


def load_digits_split(test_fraction, seed):
    """sklearn's digits (load_digits), split by a fixed permutation."""
    x, y = load_digits()
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
