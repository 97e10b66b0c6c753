"""Every rank of `mpiexec -n N python -m pytest --with-mpi tests/parallel_tf` shares one ringtrain world, started
through ringtrain.tensorflow (so a missing TensorFlow fails here, loudly, rather than skipping)."""
import pytest
import tensorflow as tf

import ringtrain.tensorflow as hvd

# a test that fails on some ranks only: every rank is back in step, with a working engine, for the next test
from rank_recovery import pytest_runtest_makereport, ranks_in_step_after_each_test  # noqa: F401

# ranks share the CPU: one thread per op keeps N processes from fighting over cores
tf.config.threading.set_intra_op_parallelism_threads(1)


@pytest.fixture(scope="session", autouse=True)
def world():
    hvd.init()
    yield hvd
    hvd.shutdown()
