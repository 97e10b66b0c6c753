"""Under RINGTRAIN_SIMULATE_NODES (tests/test_parallel.py runs this file and test_collectives.py with it set, at
4 ranks as 2+2 and 3 ranks as 2+1): the public topology queries and the engine's host transport follow the
pretend nodes, and no shared-memory window spans two of them.

Run: mpiexec -n 3 env RINGTRAIN_SIMULATE_NODES=2 python -m pytest --with-mpi tests/parallel/test_simulated_nodes.py
"""
import os

import numpy as np
import pytest

import ringtrain as rt
from ringtrain.core import state
from ringtrain.ops import DTYPES
from ringtrain.core.process_sets import _world_ranks_of
from ringtrain.topology import pretend_node

MPI = pytest.importorskip("mpi4py.MPI")
NODES = int(os.environ.get("RINGTRAIN_SIMULATE_NODES") or 0)

pytestmark = [pytest.mark.mpi(min_size=2),
              pytest.mark.skipif(NODES < 2, reason="needs RINGTRAIN_SIMULATE_NODES >= 2 (tests/test_parallel.py)")]


def pretend_layout():
    n = rt.size()
    return [[r for r in range(n) if pretend_node(r, n, NODES) == i] for i in range(NODES)]


def window_ranks(shm):
    """World ranks of the processes mapped into a shm transport's window."""
    return _world_ranks_of(shm._win, MPI.COMM_WORLD)


def test_topology_queries_follow_the_pretend_nodes():
    nodes = pretend_layout()
    mine = next(node for node in nodes if rt.rank() in node)
    assert rt.local_size() == len(mine)
    assert rt.local_rank() == mine.index(rt.rank())
    assert rt.cross_size() == sum(1 for node in nodes if len(node) > rt.local_rank())
    assert rt.cross_rank() == [node[0] for node in nodes].index(mine[0])


def test_engine_runs_the_hierarchy_and_no_window_spans_the_split():
    transport = state.engine().transports["cpu"]
    assert rt.transport_name() == "hierarchical(shm+mpi)"
    mine = next(node for node in pretend_layout() if rt.rank() in node)
    assert window_ranks(transport.intra) == mine
    for _, cross in transport.cross:
        assert cross.name == "mpi" and cross.comm.Get_size() == NODES
    # a 4 MB bucket through the API, packed into the window, against numpy
    x = np.arange(1 << 20, dtype=np.float32) % 97 + rt.rank()
    want = sum(np.arange(1 << 20, dtype=np.float32) % 97 + r for r in range(rt.size())) / rt.size()
    np.testing.assert_array_equal(rt.allreduce(x, op=rt.Average, name="sim.big"), want)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_allgather_reducescatter_broadcast_above_the_hierarchy_threshold(dtype_name):
    """Through the API, large enough for the hierarchy's allgather/reducescatter on 2+2 (reducescatter then runs in
    the engine's staging buffer, inside the shm window), flat on 2+1; every dtype, distinct per-rank inputs (small
    integers: exact in every dtype) against numpy."""
    n, me = rt.size(), rt.rank()
    dtype = DTYPES[dtype_name]
    op = rt.Max if dtype_name == "bool" else rt.Sum         # bool reduces logically (Max = or)
    rows = 2 * state.engine().transports["cpu"].hierarchy_min_bytes // dtype.itemsize // 2 // n + 3
    values = np.arange(rows * n * 2).reshape(rows * n, 2)
    inputs = [((values + r) % 2 if dtype_name == "bool" else (values * (r + 1)) % 5 + r).astype(dtype)
              for r in range(n)]
    stacked = np.stack([x.astype(np.float64) for x in inputs])
    want = stacked.max(0) if dtype_name == "bool" else stacked.sum(0)
    got = rt.reducescatter(inputs[me], op=op, name=f"sim.rs.{dtype_name}")
    counts = [rows * n // n + (1 if r < rows * n % n else 0) for r in range(n)]
    start = sum(counts[:me])
    np.testing.assert_array_equal(got.astype(np.float64), want[start: start + counts[me]])
    gathered = rt.allgather(inputs[me][: rows + me], name=f"sim.ag.{dtype_name}")
    np.testing.assert_array_equal(gathered.astype(np.float64),
                                  np.concatenate([inputs[r][: rows + r] for r in range(n)]).astype(np.float64))
    root = n - 1
    np.testing.assert_array_equal(rt.broadcast(inputs[me], root_rank=root, name=f"sim.bcast.{dtype_name}")
                                  .astype(np.float64), inputs[root].astype(np.float64))


def test_agreement_cycles_cross_the_split_as_messages(monkeypatch):
    """No agreement window spans two pretend nodes either: cached collectives agree by cycle messages, and the
    steady state needs no coordinator (the slow path only for the first sighting)."""
    from ringtrain.engine import cycle_agreement as agreement_module
    from ringtrain.engine.cycle_exchange import MessageExchange
    monkeypatch.setattr(agreement_module, "HANDOVER_S", 60.0)     # a lagging rank on a loaded machine: not tested
    agreement = state.engine().agreement
    assert isinstance(agreement._exchange, MessageExchange)
    x = np.full(300, rt.rank() + 1.0)
    rt.allreduce(x, op=rt.Sum, name="sim.cycles")                  # first sighting: through the coordinator
    slow = []
    original = agreement._slow_cycle
    agreement._slow_cycle = lambda c: slow.append(c) or original(c)
    try:
        for _ in range(20):
            got = rt.allreduce(x, op=rt.Sum, name="sim.cycles")
    finally:
        del agreement._slow_cycle
    np.testing.assert_array_equal(got, np.full(300, rt.size() * (rt.size() + 1) / 2))
    # (at most 2: see test_steady_state_agrees_on_cache_ids_past_the_first_bitmap_word on a rare slow cycle)
    assert len(slow) <= 2, f"rank {rt.rank()}: {len(slow)} slow cycles in 20 cached calls"


def test_forced_flat_ring_takes_mpi_across_the_split():
    rt.shutdown()
    try:
        rt.init(hierarchical="0")
        assert rt.transport_name() == "mpi"
        got = rt.allreduce(np.full(1001, rt.rank() + 1, np.int64), op=rt.Sum, name="sim.flat")
        np.testing.assert_array_equal(got, np.full(1001, rt.size() * (rt.size() + 1) // 2))
    finally:
        rt.shutdown()
        rt.init()
