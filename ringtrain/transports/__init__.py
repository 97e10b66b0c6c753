"""Transports: mpi, shm (host), nccl, cuda_ipc (GPU). `create(name, ...)` imports only the module it needs,
so the CPU path never imports cupy or NCCL."""
import importlib

from ..errors import TransportError

# name -> (module, class)
REGISTRY = {
    "mpi": ("mpi", "MPITransport"),
    "mpi_allreduce": ("mpi", "MPIAllreduceTransport"),   # baseline: MPI_Allreduce itself
    "shm": ("shm", "SharedMemoryTransport"),
    "nccl": ("nccl", "NCCLTransport"),
    "nccl_allreduce": ("nccl", "NCCLAllreduceTransport"),  # baseline: ncclAllReduce itself
    "cuda_ipc": ("cuda_ipc", "CudaIPCTransport"),
    "mpi_staged": ("staged", "HostStagedTransport"),       # device arrays through host buffers over MPI
}

HOST_TRANSPORTS = ("shm", "mpi", "mpi_allreduce")
DEVICE_TRANSPORTS = ("nccl", "cuda_ipc", "mpi_staged", "nccl_allreduce")


def transport_class(name):
    try:
        module, cls = REGISTRY[name]
    except KeyError:
        raise TransportError(f"unknown transport {name!r}; choose one of {sorted(REGISTRY)}") from None
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)
