"""GPU transports in one process (1 rank): NCCL ring and ncclAllReduce baseline, cuda_ipc, mpi_staged; and the
engine on cupy arrays through rt.allreduce / rt.allgather. Multi-process runs live in tests/parallel/."""
import numpy as np
import pytest

from ringtrain import gpu
from ringtrain.config import Config
from ringtrain.ops import ReduceOp
from ringtrain.engine.watchdog import Watchdog

pytestmark = pytest.mark.skipif(not gpu.available(), reason="no CUDA device")
MPI = pytest.importorskip("mpi4py.MPI")


@pytest.fixture(scope="module")
def cp():
    import cupy
    gpu.bind(0)
    return cupy


def make(name):
    from ringtrain.transports import transport_class
    return transport_class(name)(MPI.COMM_SELF.Dup(), Config(), Watchdog())


@pytest.mark.parametrize("name", ["nccl", "nccl_allreduce", "cuda_ipc", "mpi_staged"])
def test_one_rank_allreduce_and_allgather_keep_the_input(cp, name):
    t = make(name)
    try:
        for dtype in (np.float32, np.float16, np.int64):
            for n in (0, 1, 1001):
                x = np.arange(n).astype(dtype)
                buf = t.staging_buffer(x.nbytes).view(dtype)
                buf[...] = cp.asarray(x)
                cp.cuda.Device().synchronize()
                t.allreduce(buf, ReduceOp.SUM)
                t.allgather(buf, [n])
                gpu.comm_stream().synchronize()
                np.testing.assert_array_equal(buf.get(), x, err_msg=f"{name} {dtype} n={n}")
    finally:
        t.close()


def test_engine_on_cupy_arrays_one_rank(cp):
    import ringtrain as rt
    rt.init()
    try:
        assert rt.gpu_device() == 0
        x = cp.arange(10, dtype=cp.float32)
        np.testing.assert_array_equal(rt.allreduce(x, op=rt.Sum).get(), np.arange(10))
        np.testing.assert_array_equal(rt.allreduce(x, op=rt.Average, postscale_factor=2.0).get(), np.arange(10) * 2)
        np.testing.assert_array_equal(rt.allgather(x.reshape(5, 2)).get(), np.arange(10).reshape(5, 2))
        assert rt.transport_name("cuda") in ("nccl", "cuda_ipc", "mpi_staged")
    finally:
        rt.shutdown()
