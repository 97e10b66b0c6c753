"""Which transport a communicator gets: one decision, made from the topology and RINGTRAIN_TRANSPORT /
RINGTRAIN_HIERARCHICAL.

Host arrays:
- hierarchical (transports/hierarchical.py: shm inside each node, the mpi ring across nodes) when the ranks span
  more than one node and a node holds more than one rank -- or, with transport "shm", whenever they span more
  than one node (shm is then used where it can be: inside each node);
- otherwise shm when every rank shares one node, else mpi.
RINGTRAIN_HIERARCHICAL=1 forces the hierarchy (with transport "mpi" or "mpi_allreduce" that transport runs both
levels), =0 forces a flat ring ("shm" then refuses more than one node). Nodes are the topology's, so under
RINGTRAIN_SIMULATE_NODES no shared window ever spans two pretend nodes.
Device arrays: nccl when each rank of a node has its own GPU, cuda_ipc when ranks share a GPU on one node (NCCL
refuses two ranks on one device), else host-staged MPI. Creation is collective over topology.world.
"""
from ..errors import TransportError
from . import DEVICE_TRANSPORTS, HOST_TRANSPORTS, transport_class

_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def hierarchical_setting(value):
    """'auto', True or False from RINGTRAIN_HIERARCHICAL / init(hierarchical=...)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("", "auto"):
        return "auto"
    if text in _ON:
        return True
    if text in _OFF:
        return False
    raise ValueError(f"RINGTRAIN_HIERARCHICAL={value!r}: use 1 (on), 0 (off) or auto")


def host_plan(name, hierarchical, num_nodes, largest_node, size):
    """Pure decision: ("flat", transport) or ("hierarchical", intra, inter) for host arrays."""
    if name in DEVICE_TRANSPORTS or name == "auto":
        name = "auto"     # a device transport was named; host arrays still need one
    elif name not in HOST_TRANSPORTS:
        raise TransportError(f"RINGTRAIN_TRANSPORT={name!r} is not a host transport; "
                             f"choose one of {HOST_TRANSPORTS + DEVICE_TRANSPORTS}")
    setting = hierarchical_setting(hierarchical)
    if setting == "auto":
        setting = num_nodes > 1 and (name == "shm" or (name == "auto" and largest_node > 1))
    if setting:
        both = name if name in ("mpi", "mpi_allreduce") else None
        return ("hierarchical", both or "shm", both or "mpi")
    if name == "auto":
        return ("flat", "shm" if num_nodes == 1 and size > 1 else "mpi")
    if name == "shm" and num_nodes > 1:
        raise TransportError(f"transport 'shm' needs every rank on one node, but the {size} ranks span {num_nodes} "
                             "nodes and RINGTRAIN_HIERARCHICAL=0 forbids using shm inside each node; use transport "
                             "'mpi' or allow the hierarchy")
    return ("flat", name)


def host_transport(topology, config, watchdog):
    plan = host_plan(config.transport, config.hierarchical, topology.num_nodes,
                     max(len(node) for node in topology.nodes), topology.size)
    if plan[0] == "hierarchical":
        from .hierarchical import HierarchicalTransport
        return HierarchicalTransport(topology, config, watchdog, intra=plan[1], inter=plan[2])
    comm = topology.local.Dup() if plan[1] == "shm" else topology.world.Dup()   # shm only ever gets one node
    return transport_class(plan[1])(comm, config, watchdog)


def device_transport(topology, config, watchdog):
    from .. import gpu
    name = config.transport
    if name not in DEVICE_TRANSPORTS:
        ids = topology.world.allgather((topology.host, gpu.device_identity()))
        local = [i for h, i in ids if h == topology.host]     # topology.host names the pretend node when simulated
        if len(set(local)) == len(local):
            name = "nccl"
        elif topology.single_node:
            name = "cuda_ipc"
        else:
            name = "mpi_staged"
    return transport_class(name)(topology.world.Dup(), config, watchdog)
