"""ResultPool: a large result is reused only after every reference to it is gone -- never while the caller, a view,
a torch tensor over it or an in-flight request still holds it."""
import numpy as np
import pytest

import ringtrain as rt
from ringtrain.engine.fusion import HOST_OPS
from ringtrain.engine.result_pool import ResultPool

SMALL_LIMIT = 1 << 16


def address(array):
    return array.__array_interface__["data"][0]


def test_a_dropped_result_is_handed_out_again_with_the_asked_shape_and_dtype():
    pool = ResultPool(min_bytes=SMALL_LIMIT)
    first = pool.empty((64, 256), np.float32)
    where = address(first)
    del first
    again = pool.empty((128, 128), np.float32)
    assert address(again) == where and again.shape == (128, 128) and again.dtype == np.float32
    as_ints = pool.empty((32768,), np.int16)      # same bytes, another dtype: the same block once `again` is gone
    assert address(as_ints) != where
    del again
    assert address(pool.empty(16384, np.int32)) == where


@pytest.mark.parametrize("keep_alive", [
    lambda a: a,                    # the caller's variable
    lambda a: a[10:20],             # a slice (its base is the pool's block)
    lambda a: a.reshape(-1),        # a reshaped view
    lambda a: memoryview(a),        # an exported buffer
])
def test_a_result_still_referenced_is_never_reused(keep_alive):
    pool = ResultPool(min_bytes=SMALL_LIMIT)
    first = pool.empty(SMALL_LIMIT // 4, np.float32)
    first[:] = 7
    held = keep_alive(first)
    del first
    second = pool.empty(SMALL_LIMIT // 4, np.float32)
    second[:] = 0
    assert np.asarray(held).view(np.float32).max() == 7, "the pool handed out memory the caller still holds"


def test_a_torch_tensor_over_the_result_keeps_it():
    torch = pytest.importorskip("torch")
    pool = ResultPool(min_bytes=SMALL_LIMIT)
    first = pool.empty(SMALL_LIMIT // 4, np.float32)
    first[:] = 3
    tensor = torch.from_numpy(first)
    del first
    pool.empty(SMALL_LIMIT // 4, np.float32)[:] = 0
    assert float(tensor.max()) == 3


def test_small_results_are_not_pooled_and_the_pool_stays_bounded():
    pool = ResultPool(min_bytes=SMALL_LIMIT, keep=2)
    small = [pool.empty(16, np.float32) for _ in range(3)]
    assert not pool._blocks and small[0].base is None, "results below min_bytes are plain np.empty arrays"
    held = [pool.empty(SMALL_LIMIT // 4 + i, np.float32) for i in range(5)]   # all held: five distinct blocks
    assert len({address(a) for a in held}) == 5
    assert len(pool._blocks) == 2
    del held
    sizes = [(SMALL_LIMIT // 4 + 100 + i) for i in range(3)]
    for n in sizes:
        pool.empty(n, np.float32)                  # dropped at once: unused blocks of other sizes make room
    assert len(pool._blocks) == 2


def test_the_api_result_is_the_callers_and_correct_when_several_are_held():
    if not rt.is_initialized():
        rt.init()
    old = HOST_OPS.results
    HOST_OPS.results = ResultPool(min_bytes=SMALL_LIMIT)
    try:
        x = np.arange(SMALL_LIMIT // 4, dtype=np.float32)
        results = [rt.allreduce(x * k, op=rt.Sum, name="pool.held") for k in range(1, 4)]
        for k, result in enumerate(results, start=1):
            np.testing.assert_array_equal(result, x * k * rt.size())
        where = address(results[0])
        del results
        again = rt.allreduce(x, op=rt.Sum, name="pool.held")
        assert address(again) == where, "the engine still holds a finished request's output"
        np.testing.assert_array_equal(again, x * rt.size())
    finally:
        HOST_OPS.results = old


class Window:
    """A transport's shared window as shm.py hands it out: slices of one array (numpy points their views' base at
    the whole window, so the window's reference count says nothing about any one result)."""
    def __init__(self, nbytes, capacity):
        whole = np.frombuffer(bytearray(nbytes + 64), dtype=np.uint8)
        start = -address(whole) % 64                   # a window starts on a page
        self.memory = whole[start: start + nbytes]
        self.capacity = capacity
        self.next = 0

    def shared_array(self, nbytes):
        start, self.next = self.next, self.next + -(-nbytes // 64) * 64
        return self.memory[start: start + nbytes] if self.next <= self.memory.nbytes else None

    def holds(self, array):
        start = address(array) - address(self.memory)
        return 0 <= start < self.memory.nbytes


def shared_pool(window, budget=1 << 20):
    pool = ResultPool(min_bytes=1 << 30, shared_min_bytes=SMALL_LIMIT, shared_budget=budget)
    pool.attach(window)
    return pool


@pytest.mark.parametrize("keep_alive", [
    lambda a: a,
    lambda a: a[10:20],
    lambda a: a.reshape(-1).view(np.int32),
    lambda a: pytest.importorskip("torch").from_numpy(a),
    lambda a: pytest.importorskip("torch").from_numpy(a)[5:],
])
def test_a_shared_result_still_referenced_is_never_reused(keep_alive):
    window = Window(1 << 22, capacity=1 << 21)
    pool = shared_pool(window)
    first = pool.empty(SMALL_LIMIT // 4, np.float32)
    assert window.holds(first), "a result of shared size lies in the transport's window"
    first[:] = 7
    held = keep_alive(first)
    del first
    for _ in range(3):
        pool.empty(SMALL_LIMIT // 4, np.float32)[:] = 0
        other = pool.empty(SMALL_LIMIT // 4, np.float32)
        other[:] = 0
        assert np.asarray(held).view(np.float32).max() == 7, "the pool handed out window memory still held"


def test_shared_blocks_are_reused_bounded_and_given_up_at_detach():
    window = Window(1 << 22, capacity=1 << 21)
    pool = shared_pool(window, budget=3 * SMALL_LIMIT)
    first = pool.empty((SMALL_LIMIT // 8, 2), np.float32)
    where = address(first)
    del first
    again = pool.empty(SMALL_LIMIT // 8, np.float64)        # a dropped block serves the next result that fits
    assert address(again) == where and again.shape == (SMALL_LIMIT // 8,) and again.dtype == np.float64
    another = pool.empty(SMALL_LIMIT, np.uint8)               # held blocks are skipped: a new one
    assert window.holds(another) and address(another) != where
    third = pool.empty(SMALL_LIMIT // 4, np.float32)
    assert window.holds(third)
    over = pool.empty(SMALL_LIMIT // 4, np.float32)           # the budget is spent: ordinary memory
    assert not window.holds(over)
    assert not window.holds(pool.empty(16, np.float32)), "small results are not taken from the window"
    assert not window.holds(pool.empty(window.capacity + 64, np.uint8)), "nor results past the capacity"
    del again
    pool.detach(window)
    assert not window.holds(pool.empty(SMALL_LIMIT // 4, np.float32)), "a detached window is not used"


def test_results_from_the_shared_size_up_start_on_a_cache_line():
    """TF and XLA adopt a 64-byte-aligned result without a copy: every result from shared_min_bytes up is one,
    from the window, from a private block, or fresh."""
    window = Window(1 << 22, capacity=1 << 21)
    pooled = ResultPool(min_bytes=4 * SMALL_LIMIT, shared_min_bytes=SMALL_LIMIT, shared_budget=SMALL_LIMIT)
    pooled.attach(window)
    held = [pooled.empty(n, np.uint8) for n in (SMALL_LIMIT, SMALL_LIMIT + 3, 2 * SMALL_LIMIT + 1, 4 * SMALL_LIMIT,
                                                5 * SMALL_LIMIT + 7)]
    assert window.holds(held[0]) and not window.holds(held[1])
    assert [address(a) % 64 for a in held] == [0] * len(held)
    del held
    assert address(pooled.empty(4 * SMALL_LIMIT, np.uint8)) % 64 == 0      # a private block handed out again


def test_a_private_result_is_never_a_shared_block():
    window = Window(1 << 22, capacity=1 << 21)
    pool = shared_pool(window)
    private = pool.empty(SMALL_LIMIT, np.uint8, shared=False)
    assert not window.holds(private) and address(private) % 64 == 0
    assert window.holds(pool.empty(SMALL_LIMIT, np.uint8))
