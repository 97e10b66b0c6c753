"""World, node-local and cross-node communicators, the layout of the nodes, and the pids of the ranks on this machine
(for the watchdog).

A node is the ranks that share memory (`COMM_TYPE_SHARED`, where a shared window really works).
`simulate_nodes=k` (RINGTRAIN_SIMULATE_NODES) splits the world's ranks into k pretend nodes -- contiguous blocks of
ranks, as even as possible, so 3 ranks become 2+1 -- and everything that asks "which ranks share a node" (transport
choice, the shared-memory window, GPU IPC, the watchdog) sees the pretend nodes. That is how tests and benchmarks
exercise the inter-node path on one machine: traffic between pretend nodes can only take the inter-node transport.
"""
import os
import socket
import warnings

from mpi4py import MPI


def pretend_node(rank, size, nodes):
    """Which of `nodes` contiguous, as-even-as-possible blocks of range(size) holds `rank` (first blocks larger,
    like base.even_counts: 3 ranks in 2 nodes -> [0, 0, 1])."""
    base, extra = divmod(size, nodes)
    big = extra * (base + 1)               # ranks held by the first `extra` blocks, one rank larger each
    return rank // (base + 1) if rank < big else extra + (rank - big) // base


def _shared_memory_node(comm, rank):
    """The ranks that can map one shared window with us. COMM_TYPE_SHARED alone is not proof: processes joined by
    Connect/Accept (launchers/join.py) are put on one node by Split_type, yet MPICH then refuses
    Win_allocate_shared ("processes are not in the same shared memory domain"). So a one-byte window is tried, and
    where any rank of the node fails, every rank becomes a node of its own (the MPI transport then joins them), with
    a warning that names the fix."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    if node.Get_size() == 1:
        return node
    try:
        MPI.Win.Allocate_shared(1, 1, comm=node).Free()
        works = True
    except MPI.Exception:
        works = False
    if node.allreduce(works, op=MPI.LAND):
        return node
    warnings.warn(f"ringtrain: ranks {node.allgather(rank)} share this machine but cannot map one shared-memory "
                  "window, so each runs as a node of its own and the ring goes over MPI (a training step measured "
                  "1.5x a plain job's). Processes joined at init() share memory under MPICH's ofi network module: "
                  "start them with MPIR_CVAR_CH4_NETMOD=ofi.", RuntimeWarning, stacklevel=2)
    node.Free()
    return comm.Split(color=rank, key=rank)


class Topology:
    def __init__(self, comm, simulate_nodes=0):
        self.world = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        simulate_nodes = int(simulate_nodes or 0)
        if simulate_nodes < 0 or simulate_nodes > self.size:
            raise ValueError(f"RINGTRAIN_SIMULATE_NODES={simulate_nodes} must be between 1 and the number of "
                             f"ranks ({self.size}), or 0 for the real nodes")
        self.simulated_nodes = simulate_nodes
        # ranks sharing memory with us (one node); key=rank keeps local ranks in world order
        physical = _shared_memory_node(comm, self.rank)
        # the watchdog checks the pids of every rank on this machine, pretend nodes or not: a rank dying on
        # another pretend node is then named as promptly as one on ours (across real nodes no pid can be seen)
        machine_ids = physical.allgather((self.rank, os.getpid()))
        if simulate_nodes:
            self.local = physical.Split(color=pretend_node(self.rank, self.size, simulate_nodes), key=self.rank)
            physical.Free()
        else:
            self.local = physical
        self.local_rank = self.local.Get_rank()
        self.local_size = self.local.Get_size()
        # one communicator per local rank index, spanning the nodes
        self.cross = comm.Split(color=self.local_rank, key=self.rank)
        self.cross_rank = self.cross.Get_rank()
        self.cross_size = self.cross.Get_size()
        # every node's world ranks, nodes ordered by their lowest rank; the same list on every rank
        local_ranks = self.local.allgather(self.rank)
        leaders = comm.allgather(min(local_ranks))
        self.nodes = [[r for r in range(self.size) if leaders[r] == lead] for lead in sorted(set(leaders))]
        self.node_index = sorted(set(leaders)).index(leaders[self.rank])
        self.num_nodes = len(self.nodes)
        self.single_node = self.num_nodes == 1
        self.homogeneous = len({len(node) for node in self.nodes}) == 1    # every node runs as many ranks
        hostname = socket.gethostname()
        self.host = f"{hostname}/node{self.node_index}" if simulate_nodes else hostname
        self.local_peers = {r: pid for r, pid in machine_ids if r != self.rank}

    def free(self):
        for c in (self.local, self.cross):
            try:
                c.Free()
            except Exception:
                pass
