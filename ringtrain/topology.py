"""World, node-local and cross-node communicators, and the pids of this node's ranks (for the watchdog)."""
import os
import socket

from mpi4py import MPI


class Topology:
    def __init__(self, comm):
        self.world = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        # ranks sharing memory with us (one node); key=rank keeps local ranks in world order
        self.local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank = self.local.Get_rank()
        self.local_size = self.local.Get_size()
        # one communicator per local rank index, spanning the nodes
        self.cross = comm.Split(color=self.local_rank, key=self.rank)
        self.cross_rank = self.cross.Get_rank()
        self.cross_size = self.cross.Get_size()
        self.host = socket.gethostname()
        local_ids = self.local.allgather((self.rank, os.getpid()))
        self.local_peers = {r: pid for r, pid in local_ids if r != self.rank}
        self.single_node = self.local_size == self.size

    def free(self):
        for c in (self.local, self.cross):
            try:
                c.Free()
            except Exception:
                pass
