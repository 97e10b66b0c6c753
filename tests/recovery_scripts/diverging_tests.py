"""Run by tests/test_rank_recovery.py as `mpiexec -n 2 python -m pytest -p rank_recovery ...`: tests that fail on
one rank only, in the two ways ranks diverge, each followed by a test that must pass on both ranks."""
import numpy as np
import pytest

import ringtrain as rt


@pytest.fixture(scope="session", autouse=True)
def world():
    rt.init()
    yield
    rt.shutdown()


def summed(tag):
    return rt.allreduce(np.full(3, rt.rank() + 1.0), op=rt.Sum, name=tag)


def test_rank0_fails_while_rank1_waits_in_a_collective():
    summed("diverge.first")
    assert rt.rank() != 0, "rank 0 fails here on purpose"
    summed("diverge.second")          # rank 1 waits here for rank 0, which has left the test


def test_both_ranks_work_after_the_first_divergence():
    np.testing.assert_array_equal(summed("after.first"), np.full(3, 3.0))


def test_rank1_fails_after_its_last_collective():
    summed("diverge.third")
    assert rt.rank() != 1, "rank 1 fails here on purpose"


def test_both_ranks_work_after_the_second_divergence():
    np.testing.assert_array_equal(summed("after.second"), np.full(3, 3.0))
