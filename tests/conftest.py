"""Keep tests/parallel/, tests/parallel_tf/ and tests/parallel_jax/ out of the single-process run: those tests need N ranks and run as
mpiexec jobs, launched by tests/test_parallel.py, tests/test_parallel_tf.py and tests/test_parallel_jax.py. Under
`mpiexec ... pytest --with-mpi tests/parallel` they are collected as usual."""
import os

HERE = os.path.dirname(os.path.abspath(__file__))
PARALLEL_DIRS = [os.path.join(HERE, "parallel"), os.path.join(HERE, "parallel_tf"), os.path.join(HERE, "parallel_jax")]


def pytest_ignore_collect(collection_path, config):
    if config.getoption("--with-mpi", default=False):
        return None
    path = os.path.abspath(str(collection_path))
    if any(path == d or path.startswith(d + os.sep) for d in PARALLEL_DIRS):
        return True
    return None
