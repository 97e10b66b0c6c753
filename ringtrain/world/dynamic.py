"""Growing an MPI world one process at a time with MPI's dynamic processes: every member takes part in each
Accept, the joiner Connects, and the two sides Merge into one intracommunicator (the joiner last). Used by join.py
(torch.distributed-style launches) and the elastic workers (ringtrain/world/elastic_worker.py)."""
from mpi4py import MPI


def merge(intercomm, high):
    merged = intercomm.Merge(high=high)
    intercomm.Disconnect()
    return merged


def grow(world, size, rank, info=None):
    """Take part in the Accepts of the ranks that join after us, until the world has `size` processes."""
    while world.Get_size() < size:
        world = accept_one(world, None, rank, info)
    return world


def accept_one(world, port, rank, info=None):
    """One collective Accept + Merge over the current world (root 0 owns the port; others pass an empty name).
    `info` may carry MPI's "timeout" key (seconds): the root's Accept then fails when no joiner came by then."""
    accepted = world.Accept(port if rank == 0 else "", info if info is not None else MPI.INFO_NULL, root=0)
    grown = merge(accepted, high=False)
    if world != MPI.COMM_SELF:
        world.Free()
    return grown
