"""What this ringtrain can do, under Horovod's query names (`hvd.nccl_built()` and friends).

Horovod answers from how its C++ library was compiled; ringtrain is pure Python, so "built" means "usable in this
process": MPI always (it is the only controller), NCCL and CUDA when cupy finds a GPU, Gloo/DDL/oneCCL/ROCm never.
"""
import functools


def mpi_built() -> bool:
    """Always True: MPI is ringtrain's only controller."""
    return True


def mpi_enabled() -> bool:
    """MPI is ringtrain's only controller, so it is enabled whenever ringtrain runs."""
    return True


def mpi_threads_supported() -> bool:
    """True when MPI runs with MPI_THREAD_MULTIPLE (what init() asks for; process sets need it)."""
    from mpi4py import MPI
    if not MPI.Is_initialized():
        raise ValueError("mpi_threads_supported() needs MPI initialised: call init() first")
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def gloo_built() -> bool:
    """Always False: ringtrain has no Gloo controller."""
    return False


def gloo_enabled() -> bool:
    """Always False: ringtrain has no Gloo controller."""
    return False


def ddl_built() -> bool:
    """Always False: ringtrain does not use IBM DDL."""
    return False


def ccl_built() -> bool:
    """Always False: ringtrain does not use oneCCL."""
    return False


def rocm_built() -> bool:
    """Always False: ringtrain's GPU path is CUDA only."""
    return False


@functools.lru_cache(maxsize=None)
def cuda_built() -> bool:
    """True when a CUDA GPU is usable through cupy (the GPU path: cuda_ipc, nccl transports, our kernels)."""
    from .. import gpu
    return bool(gpu.available())


@functools.lru_cache(maxsize=None)
def nccl_built() -> bool:
    """True when the GPU path is usable and cupy has NCCL (the nccl transport)."""
    if not cuda_built():
        return False
    from cupy.cuda import nccl
    return bool(getattr(nccl, "available", True))
