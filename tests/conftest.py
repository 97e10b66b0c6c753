"""Keep tests/parallel/ and tests/parallel_tf/ out of the single-process run: those tests need N ranks and run as
mpiexec jobs, launched by tests/test_parallel.py and tests/test_parallel_tf.py. Under
`mpiexec ... pytest --with-mpi tests/parallel` they are collected as usual."""
import os

HERE = os.path.dirname(os.path.abspath(__file__))
PARALLEL_DIRS = [os.path.join(HERE, "parallel"), os.path.join(HERE, "parallel_tf")]


def pytest_ignore_collect(collection_path, config):
    if config.getoption("--with-mpi", default=False):
        return None
    path = os.path.abspath(str(collection_path))
    if any(path == d or path.startswith(d + os.sep) for d in PARALLEL_DIRS):
        return True
    return None
