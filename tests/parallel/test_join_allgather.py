"""Horovod's test_horovod_join_allgather at every size (3 ranks included): one rank joins while the others call
allgathers (torch and numpy). Each allgather is an error on every active rank naming the joined rank, as
Horovod's ("not supported with Join"), never a stall; after everyone joined, fifteen collectives of every kind are
correct (nothing left over from the failed ones)."""
import numpy as np
import pytest
import torch

import ringtrain as rt
import ringtrain.torch as hvd
from ringtrain.errors import RingtrainError

pytestmark = pytest.mark.mpi(min_size=2)


def test_allgather_while_a_rank_has_joined_then_fifteen_more():
    n, r = rt.size(), rt.rank()
    joiner = n - 1
    if r == joiner:
        last = hvd.join()
    else:
        # named: unnamed calls the joined rank never makes would shift its call order against the others' for
        # every later unnamed collective of this job
        for i in range(3):
            with pytest.raises(RingtrainError, match=f"rank {joiner}.*joined"):
                hvd.allgather(torch.full((2, 17), float(r)), name=f"join.gather.torch.{i}")
            with pytest.raises(RingtrainError, match=f"rank {joiner}.*joined"):
                rt.allgather(np.full(3, r, np.int32), name=f"join.gather.numpy.{i}")
        last = hvd.join()
    assert 0 <= last < n and rt.allgather_object(last) == [last] * n
    for i in range(5):      # unnamed: matched by call order, which the failed calls did not shift
        gathered = hvd.allgather(torch.full((r + 1, 3), float(r)))
        torch.testing.assert_close(gathered, torch.cat([torch.full((q + 1, 3), float(q)) for q in range(n)]))
        np.testing.assert_array_equal(rt.allreduce(np.full(4, r + 1.0), op=rt.Sum), np.full(4, n * (n + 1) / 2))
        np.testing.assert_array_equal(rt.broadcast(np.full(2, float(r)), root_rank=i % n), np.full(2, i % n))
