"""Out-of-place allreduce results that live in the shm window (result_pool's arena): numpy-equal, never changed once
returned while anything refers to them, ordinary memory when every slot is in use or the result is too big, and
mixed with ranks whose result is private or whose buffer is reduced in place in the window.

The window's limits are made small here (slots of 2 MB from 128 KB, 64 KB chunks) so cheap arrays run many chunks;
arrays are above the agreement's eager limit (1 MB at 2 ranks), so the transport reduces them."""
import numpy as np
import pytest

import ringtrain as rt
from ringtrain import stream_copy
from ringtrain.core import state
from ringtrain.engine import result_pool
from ringtrain.engine.fusion import HOST_OPS

pytestmark = [pytest.mark.mpi(min_size=2), pytest.mark.timeout(60)]

N = 300_001                     # 1.2 MB of float32: 19 chunks of 64 KB
BIG = 700_001                   # 2.8 MB: more than a slot


def rank_input(n, rank, step=0, dtype=np.float32):
    return ((np.arange(n) * 7 + 3 * rank + step) % 11 + rank).astype(dtype)


def total(n, step=0, dtype=np.float32):
    return sum(rank_input(n, r, step, np.float64) for r in range(rt.size())).astype(dtype)


@pytest.fixture(params=["streamed", "ordinary stores"])
def window(request, monkeypatch):
    """The shm transport (None on another), with a fresh pool of small window slots and short chunks."""
    transport = state.engine().transports["cpu"]
    monkeypatch.setattr(result_pool, "WINDOW_MIN_BYTES", 128 << 10)
    monkeypatch.setattr(result_pool, "WINDOW_MAX_BYTES", 2 << 20)
    monkeypatch.setattr(HOST_OPS, "results", result_pool.ResultPool())
    monkeypatch.setattr(stream_copy, "STREAM_BYTES", 1 if request.param == "streamed" else 1 << 62)
    if transport.name != "shm":
        return None
    monkeypatch.setattr(transport, "private_chunk_bytes", 64 << 10)
    return transport


def test_kept_results_never_change(window):
    kept, placed = [], []
    for step in range(8):
        x = rank_input(N, rt.rank(), step)
        y = rt.allreduce(x, op=rt.Sum, name="window.kept")
        np.testing.assert_array_equal(x, rank_input(N, rt.rank(), step))
        np.testing.assert_allclose(y, total(N, step), rtol=1e-6)
        placed.append(window is not None and window.holds(y))
        if step % 3 == 0:             # keep some (a slot stays taken), drop the others
            kept.append((step, y))
    for step, y in kept:
        np.testing.assert_allclose(y, total(N, step), rtol=1e-6, err_msg=f"the result of step {step} changed")
    if window is not None:
        # y holds the previous result while the next call runs: step 2 finds step 0's slot kept and step 1's in
        # y; from step 4 on, steps 0 and 3 keep both slots and every result is ordinary memory
        assert placed == [True, True, False, True, False, False, False, False], placed


def test_a_view_or_tensor_of_a_result_keeps_its_slot(window):
    torch = pytest.importorskip("torch")
    views = []
    for step in range(4):
        y = rt.allreduce(rank_input(N, rt.rank(), step), op=rt.Sum, name="window.view")
        views.append((step, torch.from_numpy(y[1:]) if step % 2 else y.reshape(1, -1)[:, 5:]))
        del y
    for step, v in views:
        want = total(N, step)[1:] if step % 2 else total(N, step)[5:]
        np.testing.assert_allclose(np.asarray(v).reshape(-1), want, rtol=1e-6, err_msg=f"step {step}")


def test_window_results_on_some_ranks_private_on_others(window):
    """Odd ranks hold both slots, so their results are private; even ranks get window results."""
    hold = [rt.allreduce(rank_input(N, rt.rank()), name="window.hold") for _ in range(2)]
    if rt.rank() % 2 == 0:
        hold = []
    for step in range(3):
        for dtype, op, n in ((np.float32, rt.Average, N), (np.float64, rt.Sum, N // 2), (np.int32, rt.Max, N)):
            y = rt.allreduce(rank_input(n, rt.rank(), step, dtype), op=op, name=f"window.mixed.{np.dtype(dtype)}")
            if window is not None:
                assert window.holds(y) == (rt.rank() % 2 == 0)
            inputs = [rank_input(n, r, step, np.float64) for r in range(rt.size())]
            want = np.max(inputs, axis=0) if op is rt.Max else sum(inputs) / (rt.size() if op is rt.Average else 1)
            np.testing.assert_allclose(y, want.astype(dtype), rtol=1e-6)
    del hold


def test_in_place_in_the_window_beside_window_results(window):
    """Even ranks reduce an empty_shared() array in place (one chunk where it lies), odd ranks out of place into a
    window result (chunks): the in-place ranks learn at the first barrier to run the same chunks."""
    shared = rt.empty_shared(N, np.float32)
    for step in range(3):
        if rt.rank() % 2 == 0:
            shared[:] = rank_input(N, rt.rank(), step)
            y = rt.allreduce(shared, op=rt.Sum, name="window.inplace", out=shared)
        else:
            y = rt.allreduce(rank_input(N, rt.rank(), step), op=rt.Sum, name="window.inplace")
        np.testing.assert_allclose(y, total(N, step), rtol=1e-6)


def test_in_place_and_out_of_place_interleaved(window):
    a = rank_input(N, rt.rank())
    results = []
    for step in range(4):
        b = rank_input(N, rt.rank(), step)
        rt.allreduce(b, op=rt.Sum, name="window.alt.in", out=b)
        np.testing.assert_allclose(b, total(N, step), rtol=1e-6)
        results.append(rt.allreduce(a, op=rt.Sum, name="window.alt.out"))
        np.testing.assert_array_equal(a, rank_input(N, rt.rank()))
        # a window result as the next call's input, in place and out of place
        again = rt.allreduce(results[-1], op=rt.Average, name="window.alt.again")
        np.testing.assert_allclose(again, total(N), rtol=1e-6)
    for y in results:
        np.testing.assert_allclose(y, total(N), rtol=1e-6)


def test_a_result_bigger_than_a_slot_is_ordinary_memory(window):
    for step in range(2):
        y = rt.allreduce(rank_input(BIG, rt.rank(), step), op=rt.Sum, name="window.big")
        if window is not None:
            assert not window.holds(y)
        np.testing.assert_allclose(y, total(BIG, step), rtol=1e-6)



def test_results_and_shared_arrays_have_rooms_of_their_own(monkeypatch):
    """empty_shared() gets its whole pool whether or not window results came first (and nothing past it), the
    results' room (RINGTRAIN_RESULT_WINDOW_BYTES; 0: no window results) never overlaps the pool's arrays, and
    results held past shutdown() stay readable (the window stays mapped)."""
    monkeypatch.setattr(result_pool, "WINDOW_MIN_BYTES", 128 << 10)
    monkeypatch.setattr(result_pool, "WINDOW_MAX_BYTES", 2 << 20)
    monkeypatch.setattr(HOST_OPS, "results", result_pool.ResultPool())
    want, held = [total(N), total(N, 1)], []         # (read between shutdown() and init() too)
    try:
        for room, shared in ((4 << 20, True), (0, True), (4 << 20, False)):
            rt.shutdown()
            for step, y in held:        # results of a closed world's window
                np.testing.assert_allclose(y, want[step], rtol=1e-6, err_msg=f"a held result of step {step}")
            rt.init(shared_pool_bytes=1 << 20, result_window_bytes=room)
            transport = state.engine().transports["cpu"]
            first = rt.allreduce(rank_input(N, rt.rank()), op=rt.Sum, name="window.rooms")   # a result first
            second = rt.allreduce(rank_input(N, rt.rank(), 1), op=rt.Sum, name="window.rooms")
            if transport.name == "shm":
                assert [transport.holds(y) for y in (first, second)] == [room > 0] * 2
            if shared:
                pool, past = rt.empty_shared(1 << 18, np.float32), rt.empty_shared(16, np.float32)  # 1 MB, more
                if transport.name == "shm":
                    assert [transport.holds(a) for a in (pool, past)] == [True, False]
                pool[:] = rank_input(pool.size, rt.rank(), 5)      # other values than the results'
                rt.allreduce(pool, op=rt.Sum, name="window.rooms.pool", out=pool)
                np.testing.assert_allclose(pool, total(pool.size, 5), rtol=1e-6)
            held = [(0, first), (1, second)]
            for step, y in held:
                np.testing.assert_allclose(y, want[step], rtol=1e-6)
    finally:
        rt.shutdown()
        for step, y in held:
            np.testing.assert_allclose(y, want[step], rtol=1e-6, err_msg=f"a held result of step {step}")
        rt.init()
