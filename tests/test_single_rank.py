"""One process, no mpiexec: every collective is the identity (with scales), through the real engine."""
import numpy as np
import pytest

import ringtrain as rt


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    rt.init()
    yield
    rt.shutdown()


def test_allreduce_is_identity_with_scales_and_in_place():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(rt.allreduce(x, op=rt.Average), x)
    np.testing.assert_array_equal(rt.allreduce(x, prescale_factor=2.0, postscale_factor=0.25), x * 0.5)
    y = x.copy()
    assert rt.allreduce_async(y, op=rt.Sum, out=y).wait() is y
    np.testing.assert_array_equal(y, x)
    ints = rt.grouped_allreduce([np.array([5, -5], np.int64), np.ones(0, np.int8)], op=rt.Average)
    np.testing.assert_array_equal(ints[0], [5, -5])


def test_other_collectives_on_one_rank():
    x = np.arange(6, dtype=np.int32).reshape(3, 2)
    np.testing.assert_array_equal(rt.allgather(x), x)
    np.testing.assert_array_equal(rt.broadcast(x, root_rank=0), x)
    got, splits = rt.alltoall(x)
    np.testing.assert_array_equal(got, x)
    assert splits == [3]
    np.testing.assert_array_equal(rt.reducescatter(x, op=rt.Sum), x)
    assert rt.broadcast_object({"k": 1}) == {"k": 1} and rt.allgather_object(3) == [3]
    rt.barrier()
    assert rt.join() == 0


def test_queries_and_errors():
    assert (rt.rank(), rt.size(), rt.local_rank(), rt.local_size(), rt.cross_size()) == (0, 1, 0, 1, 1)
    with pytest.raises(ValueError, match="out of range"):
        rt.broadcast(np.ones(2), root_rank=1)
