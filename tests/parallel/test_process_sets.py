"""Process sets on N ranks (2, 3, 4): collectives among a subset, vs numpy references computed from every rank's
known input. Sets used: evens/odds (disjoint, size 1 at N=2 and N=3's odds) and `pair` = [0, 1] (size 2 always)."""
import os
import re
import tempfile
import time

import numpy as np
import pytest
import torch

import ringtrain as rt
import ringtrain.torch as hvd


def value(rank, shape=(5,), dtype=np.float64):
    return (np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape) + 10.0 * rank).astype(dtype)


# first in the file: it runs before the module's sets exist
@pytest.mark.mpi(min_size=2)
def test_add_and_remove_are_collective_and_checked():
    n = rt.size()
    with pytest.raises(ValueError, match="distinct world ranks"):
        rt.add_process_set([0, n])
    with pytest.raises(ValueError, match="same ranks on every rank"):
        rt.add_process_set([rt.rank()])
    temp = rt.add_process_set([n - 1])
    with pytest.raises(ValueError, match="already registered"):
        rt.add_process_set([n - 1])
    assert rt.remove_process_set(temp) is True and temp.process_set_id is None
    with pytest.raises(ValueError, match="not registered"):
        rt.allreduce(np.ones(1), process_set=temp)
    assert rt.remove_process_set(rt.global_process_set) is False


@pytest.fixture(scope="module")
def sets():
    n = rt.size()
    evens = rt.add_process_set([r for r in range(n) if r % 2 == 0])
    odds = rt.add_process_set(rt.ProcessSet([r for r in range(n) if r % 2 == 1]))
    pair = rt.add_process_set([1, 0])               # unsorted on purpose: ranks are sorted, as Horovod does
    yield evens, odds, pair
    for s in (pair, odds, evens):
        rt.remove_process_set(s)


def mine(sets):
    evens, odds, _ = sets
    return evens if rt.rank() % 2 == 0 else odds


@pytest.mark.mpi(min_size=2)
def test_membership_queries(sets):
    evens, odds, pair = sets
    n, r = rt.size(), rt.rank()
    assert pair.ranks == [0, 1] and pair.size() == 2
    assert pair.included() == (r in (0, 1))
    assert pair.rank() == (r if r in (0, 1) else None)
    s = mine(sets)
    assert s.included() and s.rank() == s.ranks.index(r) and s.size() == len(s.ranks)
    assert rt.global_process_set.size() == n and rt.global_process_set.rank() == r
    assert len({evens.process_set_id, odds.process_set_id, pair.process_set_id, 0}) == 4


@pytest.mark.mpi(min_size=2)
def test_collectives_inside_a_set(sets):
    s = mine(sets)
    members, me = s.ranks, rt.rank()
    total = rt.allreduce(value(me), op=rt.Sum, process_set=s)
    np.testing.assert_array_equal(total, sum(value(r) for r in members))
    avg = rt.allreduce(value(me), process_set=s)               # Average divides by the set's size, not the world's
    np.testing.assert_allclose(avg, sum(value(r) for r in members) / len(members))
    gathered = rt.allgather(value(me, (me + 1, 2)), process_set=s)
    np.testing.assert_array_equal(gathered, np.concatenate([value(r, (r + 1, 2)) for r in members]))
    root = members[-1]                                          # root_rank is a world rank, as in Horovod
    np.testing.assert_array_equal(rt.broadcast(value(me), root_rank=root, process_set=s), value(root))
    k = len(members)
    rows = np.concatenate([np.full((j + 1, 2), 100 * me + j) for j in range(k)])
    received, splits = rt.alltoall(rows, splits=[j + 1 for j in range(k)], process_set=s)
    i = s.rank()
    assert list(splits) == [i + 1] * k
    np.testing.assert_array_equal(received, np.concatenate([np.full((i + 1, 2), 100 * src + i) for src in members]))
    block = rt.reducescatter(value(me, (2 * k + 1, 3)), op=rt.Sum, process_set=s)
    full = sum(value(r, (2 * k + 1, 3)) for r in members)
    np.testing.assert_array_equal(block, np.array_split(full, k)[i])
    assert rt.allgather_object(("hi", me), process_set=s) == [("hi", r) for r in members]
    assert rt.broadcast_object({"root": root, "me": me}, root_rank=root, process_set=s) == {"root": root, "me": root}
    rt.barrier(process_set=s)


@pytest.mark.mpi(min_size=2)
def test_two_rank_set_at_every_size(sets):
    """`pair` has two members at every N: a real ring inside a set, with grouped and scaled forms."""
    pair = sets[2]
    if not pair.included():
        return
    me, other = rt.rank(), [r for r in pair.ranks if r != rt.rank()][0]
    got = rt.grouped_allreduce([value(me), value(me, (2, 3), np.float32)], op=rt.Sum, prescale_factor=0.5,
                               process_set=pair)
    np.testing.assert_allclose(got[0], 0.5 * (value(me) + value(other)))
    np.testing.assert_allclose(got[1], 0.5 * (value(me, (2, 3)) + value(other, (2, 3))), rtol=1e-6)
    parts = rt.grouped_allgather([value(me, (1, 2)), value(me, (2,))], process_set=pair)
    np.testing.assert_array_equal(parts[0], np.concatenate([value(r, (1, 2)) for r in pair.ranks]))
    blocks = rt.grouped_reducescatter([value(me, (4, 2)), value(me, (3,))], op=rt.Max, process_set=pair)
    i = pair.rank()
    np.testing.assert_array_equal(blocks[0], np.array_split(np.maximum(value(me, (4, 2)), value(other, (4, 2))),
                                                            2)[i])
    np.testing.assert_array_equal(blocks[1], np.array_split(np.maximum(value(me, (3,)), value(other, (3,))), 2)[i])


@pytest.mark.mpi(min_size=2)
def test_one_name_in_the_world_and_in_a_set_that_goes_and_comes_back(sets):
    """Recurring calls keep their express plans per engine: the same name, op and array in the world and in `pair`
    each reduce over their own ranks, also after `pair` was removed and added again (a new engine, a new cache)."""
    pair = sets[2]
    me, n = rt.rank(), rt.size()
    for rnd in range(2):
        for call in range(3):
            np.testing.assert_allclose(rt.allreduce(value(me), name="ps.memo"),
                                       sum(value(r) for r in range(n)) / n, err_msg=f"world {rnd} {call}")
            if pair.included():
                got = rt.allreduce(value(me), name="ps.memo", process_set=pair)
                np.testing.assert_allclose(got, (value(0) + value(1)) / 2, err_msg=f"pair {rnd} {call}")
                parts = rt.grouped_allreduce([value(me), value(me, (3,))], name="ps.memo", process_set=pair)
                np.testing.assert_allclose(parts[1], (value(0, (3,)) + value(1, (3,))) / 2)
        rt.remove_process_set(pair)
        rt.add_process_set(pair)


@pytest.mark.mpi(min_size=2)
def test_mismatch_is_detected_inside_a_set(sets):
    pair = sets[2]
    if pair.included():
        shape = (3,) if pair.rank() == 0 else (4,)
        with pytest.raises(rt.TensorMismatchError, match="ps.mismatch"):
            rt.allreduce(np.ones(shape), name="ps.mismatch", process_set=pair)
        np.testing.assert_array_equal(rt.allreduce(np.ones(2), op=rt.Sum, process_set=pair), [2.0, 2.0])
    rt.barrier()


@pytest.mark.mpi(min_size=2)
def test_outsider_gets_a_clear_error_on_its_own(sets):
    evens, odds, _ = sets
    other = odds if rt.rank() % 2 == 0 else evens
    if other.ranks:
        with pytest.raises(ValueError, match=re.escape(f"not a member of process set {other.process_set_id} "
                                                       f"(ranks {other.ranks})")):
            rt.allreduce(np.ones(2), process_set=other)
    outsider = [r for r in range(rt.size()) if r not in mine(sets).ranks][0]
    with pytest.raises(ValueError, match=f"root_rank {outsider} is not in process set"):
        rt.broadcast(np.ones(2), root_rank=outsider, process_set=mine(sets))
    # nothing reached the other ranks: the world still works
    np.testing.assert_array_equal(rt.allreduce(np.ones(1), op=rt.Sum, name="ps.after_outsider"), [rt.size()])


@pytest.mark.mpi(min_size=2)
def test_disjoint_sets_progress_independently(sets):
    """Evens run collectives on their set while the odds are in no ringtrain call at all (they wait for a file the
    evens write when done): a set's collectives need only the set's ranks, not a world-wide agreement."""
    evens, odds, _ = sets
    marker = rt.broadcast_object(os.path.join(tempfile.gettempdir(), f"ringtrain-ps-{os.getpid()}-{time.time()}"),
                                 root_rank=0)
    if rt.rank() % 2 == 0:
        for step in range(3):
            got = rt.allreduce(np.full(3, 1.0 + step), op=rt.Sum, process_set=evens)
            np.testing.assert_array_equal(got, np.full(3, len(evens.ranks) * (1.0 + step)))
        if rt.rank() == 0:
            with open(marker, "w") as f:
                f.write("done")
    else:
        deadline = time.monotonic() + 60
        while not os.path.exists(marker):
            assert time.monotonic() < deadline, "the evens' set collectives never finished while the odds waited"
            time.sleep(0.01)
        np.testing.assert_array_equal(rt.allreduce(np.ones(2), op=rt.Sum, process_set=odds), [len(odds.ranks)] * 2)
    rt.barrier()
    if rt.rank() == 0:
        os.unlink(marker)


@pytest.mark.mpi(min_size=2)
def test_distributed_optimizer_and_broadcasts_on_a_set(sets):
    """The pair [0, 1] trains a model of its own: broadcasts and gradient averaging among its two ranks only, equal
    to one process on the pair's concatenated batches; the other ranks are not involved (and not waited for)."""
    pair = sets[2]
    if not pair.included():
        return

    def data(rank):
        return torch.randn(4, 3, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    torch.manual_seed(rt.rank())                  # different initial weights: the broadcast must fix them
    model = torch.nn.Linear(3, 2).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * (rt.rank() + 1), momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=1, process_set=pair)
    hvd.broadcast_optimizer_state(opt, root_rank=1, process_set=pair)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.2)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), process_set=pair)
    torch.manual_seed(1)
    reference = torch.nn.Linear(3, 2).double()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.2, momentum=0.9)
    for _ in range(3):
        opt.zero_grad()
        model(data(rt.rank())).pow(2).sum().backward()
        opt.step()
        ref_opt.zero_grad()
        (sum(reference(data(r)).pow(2).sum() for r in pair.ranks) / 2).backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q)
