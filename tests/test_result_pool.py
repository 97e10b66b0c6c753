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



@pytest.mark.parametrize("nbytes", [1 << 18, (1 << 18) + 3, SMALL_LIMIT * 4, SMALL_LIMIT * 4 + 7])
def test_results_from_the_aligned_size_up_start_on_a_cache_line(nbytes):
    """TF and XLA adopt a 64-byte-aligned result without a copy: every result from aligned_bytes up is one, fresh or
    from a kept block (handed out again)."""
    pool = ResultPool(min_bytes=SMALL_LIMIT * 4, aligned_bytes=1 << 18)
    first = pool.empty(nbytes, np.uint8)
    assert address(first) % 64 == 0 and first.nbytes == nbytes
    where = address(first)
    del first
    again = pool.empty(nbytes, np.uint8)
    assert address(again) % 64 == 0
    if nbytes >= SMALL_LIMIT * 4:
        assert address(again) == where, "a dropped kept block is handed out again"


def test_small_results_are_aligned_rows_never_handed_out_twice():
    """Small eager results for TF and JAX are rows of shared blocks: each aligned, C-contiguous, of the asked shape
    and dtype, each its own bytes (written with its own value, every earlier one still holds its value), blocks
    kept alive by the rows cut from them; larger ones their own allocation."""
    from ringtrain.aligned import Results
    results = Results(64, largest=1024)
    kinds = [((3,), np.float32), ((), np.float64), ((0,), np.int8), ((5, 7), np.int16), ((16,), np.float32),
             ((256,), np.float32), ((1024,), np.uint8), ((300,), np.float64)]       # the last: past `largest`
    held = []
    for i, (shape, dtype) in enumerate(kinds * 40):
        a = results.empty(shape, dtype)
        assert a.shape == shape and a.dtype == dtype and a.flags.c_contiguous and a.flags.writeable
        assert address(a) % 64 == 0, (shape, dtype)
        a[...] = i % 100
        held.append((i % 100, a))
    for value, a in held:
        assert (a == value).all()


def test_rows_taken_by_many_threads_at_once_are_all_distinct():
    import threading
    from ringtrain.aligned import Rows
    rows = Rows((16,), np.float32, 64, block_bytes=4096)      # 64 rows a block: many refills race
    taken = [[] for _ in range(4)]
    start = threading.Barrier(4)

    def take(mine):
        start.wait()
        for _ in range(3000):
            mine.append(rows.take())
    threads = [threading.Thread(target=take, args=(mine,)) for mine in taken]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    addresses = [address(a) for mine in taken for a in mine]
    assert len(set(addresses)) == len(addresses) == 12000, "a row was handed out twice"
