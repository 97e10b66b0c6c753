"""Which transport a communicator gets: one decision, made from the topology and RINGTRAIN_TRANSPORT.

Host arrays: shm when every rank shares one node (ranks reduce from each other's memory), else mpi.
Device arrays: nccl when each rank of a node has its own GPU, cuda_ipc when ranks share a GPU on one node (NCCL
refuses two ranks on one device), else host-staged MPI. Creation is collective over topology.world.
"""
from ..errors import TransportError
from . import DEVICE_TRANSPORTS, HOST_TRANSPORTS, transport_class


def host_transport(topology, config, watchdog):
    name = config.transport
    if name in DEVICE_TRANSPORTS:
        name = "auto"    # the device transport was named; host arrays still need one
    if name == "auto":
        name = "shm" if topology.single_node and topology.size > 1 else "mpi"
    if name not in HOST_TRANSPORTS:
        raise TransportError(f"RINGTRAIN_TRANSPORT={name!r} is not a host transport; "
                             f"choose one of {HOST_TRANSPORTS + DEVICE_TRANSPORTS}")
    return transport_class(name)(topology.world.Dup(), config, watchdog)


def device_transport(topology, config, watchdog):
    from .. import gpu
    name = config.transport
    if name not in DEVICE_TRANSPORTS:
        ids = topology.world.allgather((topology.host, gpu.device_identity()))
        local = [i for h, i in ids if h == topology.host]
        if len(set(local)) == len(local):
            name = "nccl"
        elif topology.single_node:
            name = "cuda_ipc"
        else:
            name = "mpi_staged"
    return transport_class(name)(topology.world.Dup(), config, watchdog)
