"""Every rank of `mpiexec -n N python -m pytest --with-mpi tests/parallel_jax` shares one ringtrain world, started
through ringtrain.jax (a missing JAX fails here, loudly). 64-bit types on, so every dtype JAX has on CPU is tested;
the training tests use float32 explicitly."""
import jax
import pytest

jax.config.update("jax_enable_x64", True)

import ringtrain.jax as hvd  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def world():
    hvd.init()
    yield hvd
    hvd.shutdown()
