"""The hierarchical transport on pretend nodes, against the flat mpi ring and a numpy reference.

Run: mpiexec -n {2,3,4} python -m pytest --with-mpi tests/parallel/test_hierarchical.py

The topology is built here with simulate_nodes, so this runs in the ordinary parallel jobs: 2 ranks as 1+1, 3 as
2+1 (uneven), 4 as 2+2 and 2+1+1. Inputs are small integers (exact in every dtype), compared bit for bit.
Tiny configs (128-byte ring segments, 50-element MPI messages, a 256-byte shared region) force pipelining,
message splitting and chunking on small buffers.
"""
import numpy as np
import pytest

from ringtrain.config import Config
from ringtrain.ops import DTYPES, ReduceOp
from ringtrain.topology import Topology
from ringtrain.transports import choice
from ringtrain.transports.base import offsets
from ringtrain.transports.hierarchical import HierarchicalTransport
from ringtrain.transports.mpi import MPITransport
from ringtrain.engine.watchdog import Watchdog
from test_transports import SMALL_SIZES, Mismatches, op_dtype_pairs, rank_inputs, reference, uneven_counts

MPI = pytest.importorskip("mpi4py.MPI")
TINY = dict(segment_bytes=128, max_message_elements=50, fusion_threshold=256)

pytestmark = pytest.mark.mpi(min_size=2)


@pytest.fixture(scope="module", params=[2, 3], ids=lambda k: f"{k}nodes")
def layout(request):
    """(topology, hierarchical transport, flat mpi transport) on `param` pretend nodes."""
    if request.param > MPI.COMM_WORLD.size:
        pytest.skip(f"{request.param} pretend nodes need at least {request.param} ranks")
    topology = Topology(MPI.COMM_WORLD, simulate_nodes=request.param)
    hierarchical = HierarchicalTransport(topology, Config(**TINY), Watchdog())
    hierarchical.intra.cache_piece_bytes = 96
    hierarchical.hierarchy_min_bytes = 0          # the hierarchy for allgather/reducescatter of any size
    flat = MPITransport(MPI.COMM_WORLD.Dup(), Config(**TINY), Watchdog())
    yield topology, hierarchical, flat
    hierarchical.close()
    flat.close()
    topology.free()


def test_pretend_nodes_are_contiguous_blocks(layout):
    topology, _, _ = layout
    n, k = topology.size, topology.simulated_nodes
    sizes = [n // k + (1 if i < n % k else 0) for i in range(k)]
    want = [list(range(sum(sizes[:i]), sum(sizes[:i + 1]))) for i in range(k)]
    assert topology.nodes == want
    mine = want[topology.node_index]
    assert topology.local_rank == mine.index(topology.rank) and topology.local_size == len(mine)
    assert topology.single_node is False and topology.num_nodes == k
    assert sorted(topology.local.allgather(topology.rank)) == mine
    assert topology.cross.allgather(topology.rank) == [node[topology.local_rank] for node in want
                                                      if len(node) > topology.local_rank]
    # the watchdog's pids: every rank of the machine, across the pretend split (these jobs run on one machine)
    assert set(topology.local_peers) == set(range(topology.size)) - {topology.rank}


def test_no_shared_window_spans_the_split(layout):
    topology, hierarchical, _ = layout
    mine = topology.nodes[topology.node_index]
    world_group = MPI.COMM_WORLD.Get_group()
    for shm in [hierarchical.intra]:
        group = shm._win.Get_group()
        in_window = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world_group)
        group.Free()
        assert sorted(in_window) == mine, f"rank {topology.rank}: shm window over {in_window}, node is {mine}"
    for block, transport in hierarchical.cross:
        assert transport.name == "mpi"
        members = transport.comm.allgather(topology.node_index)
        assert sorted(members) == list(range(topology.num_nodes)), f"block {block}: nodes {members}"
    world_group.Free()


def test_allreduce_hierarchical_equals_flat_equals_numpy(layout):
    _, hierarchical, flat = layout
    comm = MPI.COMM_WORLD
    wrong = Mismatches()
    for op, dtype_name in op_dtype_pairs():
        for size in SMALL_SIZES + [1000]:         # 1000: larger than the 256-byte shared region (chunks)
            inputs = rank_inputs(size, dtype_name, op, 11, comm.size)
            want = reference(inputs, op)
            got_hier, got_flat = inputs[comm.rank].copy(), inputs[comm.rank].copy()
            hierarchical.allreduce(got_hier, op)
            flat.allreduce(got_flat, op)
            what = f"{op.name} {dtype_name} n={size}"
            wrong.check(got_hier, want, f"hierarchical allreduce {what}")
            wrong.check(got_flat, want, f"flat allreduce {what}")
            wrong.check(got_hier, got_flat.astype(np.float64), f"hierarchical vs flat {what}")
    wrong.assert_none()


def test_allreduce_in_the_staging_region():
    """The engine packs into staging_buffer() (the shm region): reduce-scatter, the cross ring and the allgather
    then all work in place in the shared window, at rank-dependent offsets."""
    comm = MPI.COMM_WORLD
    topology = Topology(comm, simulate_nodes=2)
    t = HierarchicalTransport(topology, Config(segment_bytes=4096, fusion_threshold=1 << 20), Watchdog())
    wrong = Mismatches()
    try:
        for op, dtype_name, size in [(ReduceOp.SUM, "float32", 100003), (ReduceOp.PRODUCT, "int8", 1001),
                                     (ReduceOp.MAX, "bfloat16", 5)]:
            dtype = DTYPES[dtype_name]
            shift = 8 * comm.rank
            buf = t.staging_buffer(shift + size * dtype.itemsize)[shift:].view(dtype)
            inputs = rank_inputs(size, dtype_name, op, 12, comm.size)
            buf[...] = inputs[comm.rank]
            t.allreduce(buf, op)
            wrong.check(buf, reference(inputs, op), f"staged hierarchical allreduce {op.name} {dtype_name}")
        wrong.assert_none()
    finally:
        t.close()
        topology.free()


def test_reducescatter_allgather_broadcast_hierarchical_equals_flat_equals_numpy(layout):
    """On 2+2 (a grid) allgather and reducescatter take the hierarchy (pairwise across the column, shm inside each
    node); on 2+1 and 2+1+1 they take the flat ring; broadcast (MPI's, from every root) on every layout. Uneven
    counts (some blocks empty) and sizes above the 128-byte segment and the 256-byte shared region."""
    topology, hierarchical, flat = layout
    comm = MPI.COMM_WORLD
    n, me = comm.size, comm.rank
    wrong = Mismatches()
    for op, dtype_name in op_dtype_pairs():
        for size in (0, 7, 211, 1000):
            counts = uneven_counts(size, n)
            start, count = offsets(counts)[me], counts[me]
            inputs = rank_inputs(size, dtype_name, op, 13, n)
            want = reference(inputs, op)[start: start + count]
            got_hier, got_flat = inputs[me].copy(), inputs[me].copy()
            hierarchical.reducescatter(got_hier, counts, op)
            flat.reducescatter(got_flat, counts, op)
            what = f"reducescatter {op.name} {dtype_name} n={size}"
            wrong.check(got_hier[start: start + count], want, f"hierarchical {what}")
            wrong.check(got_flat[start: start + count], want, f"flat {what}")
    for dtype_name in DTYPES:
        for size in (0, 7, 211, 1000):
            counts = uneven_counts(size, n)
            starts = offsets(counts)
            inputs = rank_inputs(size, dtype_name, ReduceOp.SUM, 14, n)
            want = np.concatenate([inputs[r][s: s + c] for r, (s, c) in enumerate(zip(starts, counts))])
            got_hier, got_flat = np.zeros(size, DTYPES[dtype_name]), np.zeros(size, DTYPES[dtype_name])
            for got in (got_hier, got_flat):
                got[starts[me]: starts[me] + counts[me]] = inputs[me][starts[me]: starts[me] + counts[me]]
            hierarchical.allgather(got_hier, counts)
            flat.allgather(got_flat, counts)
            wrong.check(got_hier, want, f"hierarchical allgather {dtype_name} n={size}")
            wrong.check(got_flat, want, f"flat allgather {dtype_name} n={size}")
            for root in range(n):
                inputs = rank_inputs(size, dtype_name, ReduceOp.SUM, 15 + root, n)
                got_hier, got_flat = inputs[me].copy(), inputs[me].copy()
                hierarchical.broadcast(got_hier, root)
                flat.broadcast(got_flat, root)
                wrong.check(got_hier, inputs[root], f"hierarchical broadcast {dtype_name} n={size} from {root}")
                wrong.check(got_flat, inputs[root], f"flat broadcast {dtype_name} n={size} from {root}")
    wrong.assert_none()


def test_allgather_and_reducescatter_take_the_hierarchy_on_a_grid(layout, monkeypatch):
    """Which path ran: on a grid the flat ring must not be called for allgather/reducescatter (else the test above
    would pass on the flat ring alone), off a grid it must be -- and on a grid too below hierarchy_min_bytes."""
    topology, hierarchical, _ = layout
    called = []
    monkeypatch.setattr(hierarchical.flat, "allgather", lambda *a: called.append("allgather"))
    monkeypatch.setattr(hierarchical.flat, "reducescatter", lambda *a: called.append("reducescatter"))
    grid = len({len(node) for node in topology.nodes}) == 1
    for threshold, flat_expected in ((0, not grid), (1 << 20, True)):
        monkeypatch.setattr(hierarchical, "hierarchy_min_bytes", threshold)
        called.clear()
        buf = np.zeros(topology.size, np.float32)
        hierarchical.allgather(buf, [1] * topology.size)
        hierarchical.reducescatter(buf, [1] * topology.size, ReduceOp.SUM)
        want = ["allgather", "reducescatter"] if flat_expected else []
        assert called == want, f"rank {topology.rank}, hierarchy_min_bytes {threshold}: flat calls {called}"


def test_alltoall_stays_flat(layout):
    _, hierarchical, _ = layout
    comm = MPI.COMM_WORLD
    n, me = comm.size, comm.rank
    wrong = Mismatches()
    count = lambda src, dst: (3 * src + 7 * dst) % 5 * 3
    block = lambda src, dst: np.arange(count(src, dst), dtype=np.int32) + 100 * src + dst
    recv = np.zeros(sum(count(s, me) for s in range(n)), np.int32)
    hierarchical.alltoall(np.concatenate([block(me, d) for d in range(n)]), [count(me, d) for d in range(n)],
                          recv, [count(s, me) for s in range(n)])
    wrong.check(recv, np.concatenate([block(s, me) for s in range(n)]).astype(np.float64), "alltoall")
    wrong.assert_none()


def test_counts_that_do_not_split_the_buffer_raise(layout):
    topology, hierarchical, _ = layout
    buf = np.zeros(10, np.float32)
    for call in (lambda: hierarchical.allgather(buf, [3] * topology.size),
                 lambda: hierarchical.reducescatter(buf, [3] * topology.size, ReduceOp.SUM)):
        with pytest.raises(ValueError, match=r"rank \d+: counts .* do not split a buffer of 10 elements"):
            call()


def test_choice_under_the_split_never_gives_shm_a_second_node():
    comm = MPI.COMM_WORLD
    topology = Topology(comm, simulate_nodes=2)
    try:
        t = choice.host_transport(topology, Config(transport="shm"), Watchdog())
        try:
            assert isinstance(t, HierarchicalTransport) and t.name == "hierarchical(shm+mpi)"
            assert t.intra.size == topology.local_size
        finally:
            t.close()
        flat = choice.host_transport(topology, Config(hierarchical="0"), Watchdog())
        try:
            assert flat.name == "mpi"
        finally:
            flat.close()
    finally:
        topology.free()


@pytest.mark.parametrize("fusion_threshold", [256, 1 << 20], ids=["chunked", "in-region"])
def test_allreduce_out_scales_into_dst_and_leaves_src(fusion_threshold):
    """What the engine calls for one array: dst <- scale * allreduce(src), src untouched; also in place."""
    comm = MPI.COMM_WORLD
    topology = Topology(comm, simulate_nodes=2)
    t = HierarchicalTransport(topology, Config(segment_bytes=4096, fusion_threshold=fusion_threshold), Watchdog())
    wrong = Mismatches()
    try:
        for op, dtype_name, size in [(ReduceOp.SUM, "float32", 30011), (ReduceOp.MAX, "int32", 7),
                                     (ReduceOp.SUM, "float64", 0)]:
            inputs = rank_inputs(size, dtype_name, op, 15, comm.size)
            src = inputs[comm.rank].copy()
            dst = np.full(size, 99, DTYPES[dtype_name])
            t.allreduce_out(src, dst, op, 0.5 if dtype_name.startswith("float") else 1.0)
            factor = 0.5 if dtype_name.startswith("float") else 1.0
            wrong.check(dst, reference(inputs, op) * factor, f"allreduce_out {op.name} {dtype_name} n={size}")
            wrong.check(src, inputs[comm.rank].astype(np.float64), f"src after allreduce_out {dtype_name}")
            t.allreduce_out(src, src, op)
            wrong.check(src, reference(inputs, op), f"in-place allreduce_out {op.name} {dtype_name}")
        wrong.assert_none()
    finally:
        t.close()
        topology.free()


def test_shm_reducescatter_out_reads_src_and_leaves_it(layout):
    """The intra-node step of allreduce_out: dst's own block gets the node's reduction, src stays as it was --
    also in place (dst is src), with src inside the shared region, chunked (1000 > the 256-byte region)."""
    topology, hierarchical, _ = layout
    shm = hierarchical.intra
    wrong = Mismatches()
    for op, dtype_name in [(ReduceOp.SUM, "float32"), (ReduceOp.MIN, "int16")]:
        dtype = DTYPES[dtype_name]
        for size, where in [(7, "private"), (1000, "private"), (1000, "in place"), (40, "src in region"), (0, "private")]:
            inputs = rank_inputs(size, dtype_name, op, 16, topology.size)
            node = [inputs[p] for p in topology.nodes[topology.node_index]]
            counts = uneven_counts(size, shm.size)
            start, count = offsets(counts)[shm.rank], counts[shm.rank]
            src = inputs[topology.rank].copy()
            if where == "src in region":
                src = shm.staging_buffer(src.nbytes).view(dtype)
                src[...] = inputs[topology.rank]
            dst = src if where == "in place" else np.full(size, 99, dtype)
            shm.reducescatter_out(src, dst, counts, op)
            what = f"shm reducescatter_out {op.name} {dtype_name} n={size} {where}"
            want = reference(node, op)
            wrong.check(dst[start: start + count], want[start: start + count], what)
            if where != "in place":
                wrong.check(src, inputs[topology.rank].astype(np.float64), f"src after {what}")
    wrong.assert_none()
