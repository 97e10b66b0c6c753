"""A synchronous grouped allreduce of host arrays takes the express path too: one agreement cycle on the caller's
thread, then the shm transport reduces the arrays where they lie (Segments: only the blocks peers read are copied
in, only the blocks they reduced are copied out) instead of packing them into a bucket and unpacking it. Block
boundaries fall inside arrays, chunks split every array, small groups and groups with an array in the shm window
are packed, and a cycle that decides otherwise turns the call into an ordinary grouped request: the same result
as numpy every time."""
import time

import numpy as np
import pytest

from mpi4py import MPI

import ringtrain as rt
from ringtrain.core import state
from ringtrain.transports.segments import Segments

pytestmark = pytest.mark.mpi(min_size=2)


def group(sizes, salt, dtype=np.float32):
    """Per rank: arrays of `sizes` with values that differ by rank, and their exact sum."""
    mine = [((np.arange(n) * 7 + 3 * rt.rank() + salt + i) % 97).astype(dtype) for i, n in enumerate(sizes)]
    total = [sum(((np.arange(n) * 7 + 3 * r + salt + i) % 97).astype(np.float64) for r in range(rt.size()))
             for i, n in enumerate(sizes)]
    return mine, total


def assert_some_read_where_they_lie(direct, call, checked=True, more=30):
    """With a core per rank most cached calls end in their express cycle and read the arrays where they lie (a
    peer's idle engine thread joining a cycle first, or a rank descheduled on a loaded machine, sends one to the
    general path now and then): while a rank has none, `call()` makes one more cached call, up to `more` of them,
    and then every rank must have read some where they lie -- a path never taken never does. With more ranks than
    cores that happens to most of them, so the path is only checked where every rank has a core (and on the ranks
    where `checked`). Every rank calls this."""
    comm = MPI.COMM_WORLD
    mine = bool(checked and state.engine().watchdog.core_per_rank)
    for _ in range(more):
        if not comm.allreduce(mine and True not in direct, op=MPI.LOR):
            return
        call()
    missing = [r for r, m in enumerate(comm.allgather(mine and True not in direct)) if m]
    assert not missing, f"ranks {missing}: no call read the arrays where they lie in {len(direct)} calls"


@pytest.fixture
def direct(monkeypatch):
    """Per call of the shm transport's collective: whether it read Segments where they lie."""
    transport = state.engine().executor.transport("cpu")
    seen = []
    real = transport._collective

    def spy(buf, *args, **kwargs):
        seen.append(isinstance(buf, Segments))
        return real(buf, *args, **kwargs)
    monkeypatch.setattr(transport, "_collective", spy)
    return seen


# sizes: block boundaries inside arrays, arrays of one element, past the 64 KB one-barrier path
@pytest.mark.parametrize("sizes", [(40001, 3, 70000, 1, 12345), (100000, 100000)], ids=["uneven", "two"])
def test_a_cached_grouped_allreduce_is_reduced_where_its_arrays_lie(direct, sizes):
    x, want = group(sizes, 1)

    def summed(call="more"):
        out = rt.grouped_allreduce(x, op=rt.Sum, name=f"grouped.express.{len(sizes)}")
        for o, w in zip(out, want):
            np.testing.assert_array_equal(o, w, err_msg=f"call {call}")
    for call in range(6):
        summed(call)
        inplace = [a.copy() for a in x]
        result = rt.grouped_allreduce(inplace, name=f"grouped.express.inplace.{len(sizes)}", outs=inplace)
        assert all(r is a for r, a in zip(result, inplace))
        for a, w in zip(inplace, want):
            np.testing.assert_allclose(a, w / rt.size(), rtol=1e-6, err_msg=f"call {call}")
        assert [a.tolist() for a in x] == [b.tolist() for b in group(sizes, 1)[0]], "the inputs were written"
    assert_some_read_where_they_lie(direct, summed)      # the first sightings go through requests (packed)
    assert not state.engine().requests


def test_a_group_larger_than_a_chunk_splits_every_array_over_the_chunks(direct):
    from ringtrain.transports.shm import SharedMemoryTransport
    n = SharedMemoryTransport.private_chunk_bytes // 4 // 2 + 999      # two arrays, together past one chunk
    x, want = group((n, 17, n + 5), 2)

    def summed(call="more"):
        out = rt.grouped_allreduce(x, op=rt.Sum, name="grouped.express.chunks")
        for o, w in zip(out, want):
            np.testing.assert_array_equal(o, w, err_msg=f"call {call}")
    for call in range(4):
        summed(call)
    assert_some_read_where_they_lie(direct, summed)


@pytest.mark.parametrize("dtypes", [(np.float32,), (np.float64, np.int32)], ids=["small", "mixed_dtypes"])
def test_small_and_mixed_dtype_groups(dtypes):
    """Small groups take the one-barrier path (packed); several dtypes make one express call per dtype."""
    sizes = (300, 5, 4000)
    parts = [group(sizes, 3 + k, dtype) for k, dtype in enumerate(dtypes)]
    x = [a for mine, _ in parts for a in mine]
    want = [w for _, total in parts for w in total]
    for call in range(4):
        out = rt.grouped_allreduce(x, op=rt.Sum, name=f"grouped.express.small.{len(dtypes)}")
        assert [o.dtype for o in out] == [a.dtype for a in x]
        for o, w in zip(out, want):
            np.testing.assert_array_equal(o, w, err_msg=f"call {call}")


def test_integer_average_with_empty_arrays_in_the_group(direct):
    sizes = (0, 30000, 0, 50001, 0)
    x, want = group(sizes, 6, np.int32)

    def averaged(call="more"):
        out = rt.grouped_allreduce(x, name="grouped.express.int_average")
        for o, w in zip(out, want):
            np.testing.assert_array_equal(o, np.trunc(w / rt.size()).astype(np.int32), err_msg=f"call {call}")
    for call in range(4):
        averaged(call)
    assert_some_read_where_they_lie(direct, averaged)


def test_a_rank_with_an_array_in_the_window_packs_while_the_others_do_not(direct):
    sizes = (30000, 50001)
    x, want = group(sizes, 4)
    mine = [rt.empty_shared(n, np.float32) if rt.rank() == 0 and i == 1 else np.empty(n, np.float32)
            for i, n in enumerate(sizes)]
    for call in range(4):
        for m, a in zip(mine, x):
            m[...] = a
        rt.grouped_allreduce(mine, op=rt.Sum, name="grouped.express.window", outs=mine)
        for m, w in zip(mine, want):
            np.testing.assert_array_equal(m, w, err_msg=f"call {call}")
    if rt.rank() == 0:
        assert True not in direct, direct            # its array in the window: packed
    assert not state.engine().requests


@pytest.mark.parametrize("outs", ["back to back in the window", "on rank 0 only", "scattered in the window"])
def test_private_arrays_reduced_into_a_bucket_of_the_window(outs):
    """A refilled gradient bucket: private arrays reduced into views of one flat array of the window laid out as
    they are -- reduced into it as one buffer of the region, nothing copied out; a rank whose outs are private
    beside it runs the same chunks; outs in the window out of order are packed. Numpy's result every time."""
    transport = state.engine().executor.transport("cpu")
    sizes = (30000, 7, 0, 50001, 20000)
    x, want = group(sizes, 7)
    shared = outs != "on rank 0 only" or rt.rank() == 0
    flat = rt.empty_shared(sum(sizes), np.float32) if shared else np.empty(sum(sizes), np.float32)
    views = np.split(flat, np.cumsum(sizes)[:-1])
    if outs == "scattered in the window":      # the same pieces of flat, in reverse order
        views = np.split(flat, np.cumsum(sizes[::-1])[:-1])[::-1]
    seen = []
    if transport.name == "shm":
        real = transport._collective
        transport._collective = lambda buf, *a, out=None, **k: seen.append(
            out is not None and transport._offset_in_region(out) is not None) or real(buf, *a, out=out, **k)

    def reduced(call="more"):
        flat[...] = -1
        result = rt.grouped_allreduce(x, op=rt.Sum, name=f"grouped.express.into.{outs}", outs=views)
        assert all(r is v for r, v in zip(result, views))
        for v, w in zip(views, want):
            np.testing.assert_array_equal(v, w, err_msg=f"call {call}")
    try:
        for call in range(4):
            reduced(call)
        assert_some_read_where_they_lie(seen, reduced,
                                        checked=transport.name == "shm" and shared and outs != "scattered in the window")
    finally:
        if transport.name == "shm":
            del transport._collective


@pytest.mark.parametrize("sizes", [(20000, 7, 30000), (200, 7, 300)], ids=["where_they_lie", "small"])
def test_a_flagged_cycle_turns_the_grouped_call_into_a_request(sizes):
    """The last rank first submits a never-seen tensor (a slow cycle), 0.3 s before the cached group the others
    already wait for: their express cycle sees the flag and the group becomes an ordinary grouped request on every
    rank (a small group's: a request on its packed inputs), whose handle still returns the list of results."""
    x, want = group(sizes, 5)
    fresh = np.full(5, rt.rank() + 1.0, np.float32)
    late = rt.rank() == rt.size() - 1
    name = f"grouped.express.flagged.{len(sizes)}.{sizes[0]}"
    rt.grouped_allreduce(x, op=rt.Sum, name=name)
    eng = state.engine()
    made = []
    real = eng._express_request
    eng._express_request = lambda name, *args: made.append(name) or real(name, *args)
    try:
        for call in range(3):
            rt.barrier()
            if late:
                handle = rt.allreduce_async(fresh, op=rt.Sum, name=f"grouped.express.fresh.{call}")
                time.sleep(0.3)
                out = rt.grouped_allreduce(x, op=rt.Sum, name=name)
                other = handle.wait()
            else:
                out = rt.grouped_allreduce(x, op=rt.Sum, name=name)
                other = rt.allreduce(fresh, op=rt.Sum, name=f"grouped.express.fresh.{call}")
            assert isinstance(out, list) and len(out) == 3
            for o, w in zip(out, want):
                np.testing.assert_array_equal(o, w, err_msg=f"call {call}")
            np.testing.assert_array_equal(other, np.full(5, sum(range(1, rt.size() + 1)), np.float32))
    finally:
        del eng._express_request
    if not late:
        assert made.count(name) >= 1, made      # the grouped request path ran
    assert not eng.requests
