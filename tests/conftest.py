"""Keep tests/parallel/ out of the single-process run: those tests need N ranks and run as mpiexec jobs, launched by
tests/test_parallel.py. Under `mpiexec ... pytest --with-mpi tests/parallel` they are collected as usual."""
import os

PARALLEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "parallel")


def pytest_ignore_collect(collection_path, config):
    if config.getoption("--with-mpi", default=False):
        return None
    path = os.path.abspath(str(collection_path))
    if path == PARALLEL_DIR or path.startswith(PARALLEL_DIR + os.sep):
        return True
    return None
