"""Pure pieces of the scale-out path: pretend-node layout, hierarchical block ownership, the host transport plan."""
import pytest

from ringtrain.errors import TransportError
from ringtrain.topology import pretend_node
from ringtrain.transports.choice import hierarchical_setting, host_plan
from ringtrain.transports.hierarchical import block_owners


@pytest.mark.parametrize("size,nodes,want", [
    (4, 2, [0, 0, 1, 1]), (3, 2, [0, 0, 1]), (4, 3, [0, 0, 1, 2]), (5, 1, [0] * 5), (2, 2, [0, 1]),
    (7, 3, [0, 0, 0, 1, 1, 2, 2]),
])
def test_pretend_nodes_are_contiguous_and_as_even_as_possible(size, nodes, want):
    assert [pretend_node(r, size, nodes) for r in range(size)] == want


@pytest.mark.parametrize("node_size,blocks,want", [
    (2, 2, [(0, 1), (1, 2)]), (1, 2, [(0, 2)]), (1, 1, [(0, 1)]), (2, 3, [(0, 1), (1, 3)]),
    (3, 3, [(0, 1), (1, 2), (2, 3)]),
])
def test_every_local_rank_owns_contiguous_blocks_covering_all(node_size, blocks, want):
    owned = block_owners(node_size, blocks)
    assert owned == want
    assert all(end > first for first, end in owned)


@pytest.mark.parametrize("name,hier,nodes,largest,want", [
    ("auto", "auto", 1, 4, ("flat", "shm")),
    ("auto", "auto", 2, 2, ("hierarchical", "shm", "mpi")),
    ("auto", "auto", 2, 1, ("flat", "mpi")),                  # one rank per node: the flat ring is the hierarchy
    ("shm", "auto", 2, 1, ("hierarchical", "shm", "mpi")),    # shm where it can be: inside each node
    ("mpi", "auto", 2, 2, ("flat", "mpi")),
    ("mpi", "1", 2, 2, ("hierarchical", "mpi", "mpi")),
    ("mpi_allreduce", "on", 2, 2, ("hierarchical", "mpi_allreduce", "mpi_allreduce")),
    ("auto", "0", 2, 2, ("flat", "mpi")),
    ("auto", "1", 1, 4, ("hierarchical", "shm", "mpi")),
    ("nccl", "auto", 2, 2, ("hierarchical", "shm", "mpi")),   # a device transport named: host still chooses
    ("auto", "auto", 1, 1, ("flat", "mpi")),                  # one rank alone
])
def test_host_plan(name, hier, nodes, largest, want):
    size = nodes * largest
    assert host_plan(name, hier, nodes, largest, size) == want


def test_host_plan_refuses_shm_across_nodes_without_the_hierarchy():
    with pytest.raises(TransportError, match="span 2 nodes"):
        host_plan("shm", "0", 2, 2, 4)
    with pytest.raises(TransportError, match="not a host transport"):
        host_plan("tcp", "auto", 1, 2, 2)


def test_hierarchical_setting_parses_and_names_bad_values():
    assert [hierarchical_setting(v) for v in ("auto", "", "1", "ON", "0", "false", True)] == \
        ["auto", "auto", True, True, False, False, True]
    with pytest.raises(ValueError, match="RINGTRAIN_HIERARCHICAL='maybe'"):
        hierarchical_setting("maybe")
