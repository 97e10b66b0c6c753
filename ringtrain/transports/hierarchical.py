"""Hierarchical allreduce for ranks on several nodes: reduce-scatter inside each node, a ring across the nodes,
allgather inside each node. A flat ring over N = n nodes x g ranks puts the whole buffer on every link, the
network links included; here only 1/g of it leaves each rank, and the intra-node steps run on shared memory.

    t = HierarchicalTransport(topology, Config(), Watchdog())       # intra "shm", inter "mpi"
    bucket = t.staging_buffer(nbytes).view(np.float32)               # this rank's region of the node's window
    bucket[:] = gradients
    t.allreduce(bucket, ReduceOp.SUM)
    t.close()

Blocks. The buffer is cut into B = (ranks on the largest node) blocks. On a node of g ranks, local rank j owns the
contiguous blocks [j*B//g, (j+1)*B//g), so every local rank owns at least one block and, on even layouts (g == B
on every node), local rank j owns exactly block j. Block b is reduced across the nodes by the ranks that own it,
one per node, on their own communicator: with even nodes that is the usual "ring among equal local ranks".
Uneven nodes work the same way: with 3 ranks as 2+1, rank 2 (alone on its node) owns both blocks and takes part
in both cross-node rings, one after the other (ranks 0 and 1 each in one); it is the bottleneck, as the node
holding all of its node's data must be.

allreduce of a buffer:
  1. intra.reducescatter(buf, counts of each local rank's blocks)   -- shm: read peers' memory, no copies
  2. for each owned block b: cross[b].allreduce(block b)            -- mpi ring, the only inter-node traffic
  3. intra.allgather(buf, same counts)
allreduce_out(src, dst) -- the engine's one-array path -- takes no staging copy: step 1 reads src and writes the
reduced blocks into dst (shm copies in only the blocks its peers read), step 2 runs in place on dst (a scale is
applied between the cross ring's reduce-scatter and allgather, to 1/n of the block), step 3 copies this rank's
block into its region once and fills dst's other blocks from the peers' regions.

broadcast stays MPI's own (Ibcast over the world). A two-level broadcast (root -> one rank per node over MPI, then
inside each node) was built and measured on 2+2 pretend nodes: 0.69-1.05x of MPI's Ibcast at 4 KB-16 MB, mostly
~0.8x (benchmarks/results/pretend_collectives_raw_4.txt, op broadcast-two-level). Two full-size steps in a row
cost more than one, and nothing is saved: MPI's binomial tree, or its scatter + allgather for large messages, over
nodes that are contiguous rank ranges already sends each byte across each node boundary about once, and MPICH's
ch4 device has node-aware Ibcast compositions of its own.
allgather and reducescatter, on a grid (every node g ranks, node k = world ranks k*g .. k*g+g-1, the layout of
pretend nodes and of hostfile/Slurm block placement): rank (node i, local rank j) talks across nodes only with the
ranks of local rank j -- its "column" -- and the blocks it exchanges there are single blocks (pairwise.py), so each
node's g ranks share the cross-node traffic and no byte crosses twice.
  allgather:     1. pairwise across the column: our block to every node, theirs straight into buf
                 2. per node k: intra.allgather of node k's g blocks (each local rank now holds its block of node k)
  reducescatter: 1. per node k: intra.reducescatter of node k's g blocks (local rank j: block (k, j) over this node)
                 2. pairwise across the column: partial sums of block (k, j) go to node k, ours come in and reduce
Neither cuts the bytes leaving a node (a flat ring's node-boundary link carries each byte once per direction
too); they cut the cross-node steps from N-1 to n-1 and move the node-local part over shared memory. Measured on
2+2 pretend nodes, transports alone (benchmarks/results/pretend_collectives_raw_4.txt): below 64 KB the hierarchy
is 0.65-1.01x the flat ring (two shm calls of two barriers each, plus the pairwise step, against three ring steps),
from 64 KB to 16 MB 0.91-1.69x for allgather and 1.07-1.18x for reducescatter -- so buffers under
`hierarchy_min_bytes` take the flat ring. Other layouts
(uneven nodes such as 2+1, nodes that are not contiguous rank ranges) take the flat ring: there a column is not one
rank per node, and a lone rank would have to stand in for several -- not built. alltoall is always flat.
AVERAGE arrives as SUM (transports/base.py); the engine scales.
"""
from mpi4py import MPI

from ..ops import scale_into
from .base import Transport, even_counts, offsets
from .pairwise import allgather_views, reducescatter_views
from . import transport_class


def block_owners(node_size, num_blocks):
    """[(first block, end block)] owned by each local rank of a node with node_size ranks."""
    return [(j * num_blocks // node_size, (j + 1) * num_blocks // node_size) for j in range(node_size)]


def is_grid(nodes):
    """Every node holds g ranks and node k is world ranks k*g .. k*g+g-1."""
    g = len(nodes[0])
    return all(node == list(range(k * g, (k + 1) * g)) for k, node in enumerate(nodes))


def cross_allreduce(transport, block, op, scale):
    """block <- scale * block reduced over transport's ranks. The scale is applied between the reduce-scatter and
    the allgather, to the 1/n of the block this rank finished: one pass over 1/(n*g) of the data, not 1/g."""
    if scale == 1.0 or transport.size == 1:
        transport.allreduce(block, op)
        if scale != 1.0:
            scale_into(block, block, scale)
        return
    counts = even_counts(block.size, transport.size)
    transport.reducescatter(block, counts, op)
    start = offsets(counts)[transport.rank]
    finished = block[start: start + counts[transport.rank]]
    scale_into(finished, finished, scale)
    transport.allgather(block, counts)


class HierarchicalTransport(Transport):
    """Composes an intra-node transport (on topology.local) with inter-node rings among the owners of each block.
    Creation is collective over topology.world."""

    device = "cpu"
    hierarchy_min_bytes = 64 << 10     # allgather/reducescatter of smaller buffers take the flat ring (see above)

    def __init__(self, topology, config, watchdog, intra="shm", inter="mpi"):
        super().__init__(topology.world, config, watchdog)     # self.comm is not ours: close() leaves it
        self.name = f"hierarchical({intra}+{inter})"
        self.num_blocks = max(len(node) for node in topology.nodes)
        self._owned = block_owners(topology.local_size, self.num_blocks)
        first, end = self._owned[topology.local_rank]
        self._transports = []
        self.intra = transport_class(intra)(topology.local.Dup(), config, watchdog)
        self._transports.append(self.intra)
        # one communicator per block, over the ranks that own it (one per node); Split is collective on world
        self.cross = []
        for block in range(self.num_blocks):
            comm = topology.world.Split(color=0 if first <= block < end else MPI.UNDEFINED, key=self.rank)
            if comm != MPI.COMM_NULL:
                self.cross.append((block, transport_class(inter)(comm, config, watchdog)))
                self._transports.append(self.cross[-1][1])
        self.flat = transport_class(inter)(topology.world.Dup(), config, watchdog)
        self._transports.append(self.flat)
        self._nodes = topology.nodes
        self._grid = is_grid(topology.nodes)

    def staging_buffer(self, nbytes):
        """The intra transport's buffer (shm: our region of the node window, so packing is the copy-in)."""
        return self.intra.staging_buffer(nbytes)

    def allreduce(self, buf, op):
        if self.size == 1 or buf.size == 0:
            return
        blocks = even_counts(buf.size, self.num_blocks)
        starts = offsets(blocks)
        intra_counts = [sum(blocks[first:end]) for first, end in self._owned]
        self.intra.reducescatter(buf, intra_counts, op)
        for block, transport in self.cross:
            transport.allreduce(buf[starts[block]: starts[block] + blocks[block]], op)
        self.intra.allgather(buf, intra_counts)

    def allreduce_out(self, src, dst, op, scale=1.0):
        """dst <- scale * allreduce(src), src untouched, with no staging copy: the intra-node reduce-scatter reads
        src and writes the reduced blocks into dst, the cross-node rings run in place on dst, and the intra-node
        allgather fills dst's other blocks from the peers' regions."""
        if self.size == 1 or src.size == 0:
            scale_into(dst, src, scale)
            return
        blocks = even_counts(src.size, self.num_blocks)
        starts = offsets(blocks)
        intra_counts = [sum(blocks[first:end]) for first, end in self._owned]
        self.intra.reducescatter_out(src, dst, intra_counts, op)    # shm reads src directly
        for block, transport in self.cross:
            cross_allreduce(transport, dst[starts[block]: starts[block] + blocks[block]], op, scale)
        self.intra.allgather(dst, intra_counts)

    def broadcast(self, buf, root):
        self.flat.broadcast(buf, root)

    def _columns(self, buf, counts):
        """[views of this rank's column, one per node], [(node k's span of buf, its g counts)], on a grid."""
        g, j, starts = len(self._nodes[0]), self.intra.rank, offsets(counts)
        column = [buf[starts[k * g + j]: starts[k * g + j] + counts[k * g + j]] for k in range(len(self._nodes))]
        spans = [(buf[starts[k * g]: starts[k * g] + sum(counts[k * g: k * g + g])], counts[k * g: k * g + g])
                 for k in range(len(self._nodes))]
        return column, spans

    def allgather(self, buf, counts):
        self.check_counts(buf, counts)
        if not self._grid or buf.nbytes < self.hierarchy_min_bytes:
            self.flat.allgather(buf, counts)
            return
        column, spans = self._columns(buf, counts)
        allgather_views(self.cross[0][1], column)
        for span, node_counts in spans:
            self.intra.allgather(span, node_counts)

    def reducescatter(self, buf, counts, op):
        self.check_counts(buf, counts)
        if not self._grid or buf.nbytes < self.hierarchy_min_bytes:
            self.flat.reducescatter(buf, counts, op)
            return
        column, spans = self._columns(buf, counts)
        for span, node_counts in spans:
            self.intra.reducescatter(span, node_counts, op)
        reducescatter_views(self.cross[0][1], column, op)

    def alltoall(self, send, send_counts, recv, recv_counts):
        self.flat.alltoall(send, send_counts, recv, recv_counts)

    def close(self):
        transports, self._transports = self._transports, []
        for transport in transports:
            transport.close()
