"""join() as Horovod's: one rank joins while the others keep running collectives. Its allreduces take zeros from the
joined rank (Average still divides by the full size, integers rounding toward zero), for every dtype, whichever rank
joins first and whether the names are cached or seen for the first time; a broadcast meanwhile is an error on
every active rank naming the joined one ("not supported with Join", as Horovod); join() returns the last rank to
join, the same on every rank; afterwards the job works normally."""
import ml_dtypes
import numpy as np
import pytest

import ringtrain as rt
from ringtrain.errors import RingtrainError
from ringtrain.ops import DTYPES

pytestmark = pytest.mark.mpi(min_size=2)

NUMERIC = [name for name in DTYPES if name != "bool"]


def values(rank, dtype):
    """Small per-rank values, negatives included where the dtype has them (so truncation toward zero shows)."""
    low = 0 if np.dtype(DTYPES[dtype]).kind == "u" else -9
    array = (np.arange(11) * 7 + 5 * rank) % 19 + low
    return array.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else DTYPES[dtype])


def expected(active, dtype, op, size):
    total = sum(values(r, dtype).astype(np.float64) for r in active)
    if op == rt.Average:
        total = np.trunc(total / size) if np.dtype(DTYPES[dtype]).kind in "iu" else total / size
    return total


@pytest.mark.parametrize("cached", [False, True], ids=["first_sighting", "cached"])
@pytest.mark.parametrize("first", ["rank0", "last_rank"])
def test_join_while_others_allreduce_and_broadcast(first, cached):
    n, r = rt.size(), rt.rank()
    joiner = 0 if first == "rank0" else n - 1
    active = [q for q in range(n) if q != joiner]
    tag = f"join.{first}.{cached}"
    if cached:      # every rank runs each name once first: while the joiner waits they are cached responses
        for dtype in NUMERIC:
            for op in (rt.Sum, rt.Average):
                rt.allreduce(values(r, dtype), op=op, name=f"{tag}.{dtype}.{op.name}")
    if r == joiner:
        last = rt.join()
    else:
        for dtype in NUMERIC:
            for op in (rt.Sum, rt.Average):
                got = rt.allreduce(values(r, dtype), op=op, name=f"{tag}.{dtype}.{op.name}")
                tolerance = 0.05 if dtype in ("float16", "bfloat16") else 0
                np.testing.assert_allclose(got.astype(np.float64), expected(active, dtype, op, n), atol=tolerance,
                                           err_msg=f"rank {r}: {dtype} {op.name} with rank {joiner} joined")
        with pytest.raises(RingtrainError, match=f"rank {joiner}.*joined"):
            rt.broadcast(values(r, "float32"), root_rank=active[0], name=f"{tag}.broadcast")
        last = rt.join()
    everyone = rt.allgather_object(last, name=f"{tag}.last")
    assert everyone == [last] * n and last != joiner
    # the job goes on: a broadcast and an allreduce with nobody joined
    np.testing.assert_array_equal(rt.broadcast(np.full(3, float(r)), root_rank=joiner, name=f"{tag}.after"),
                                  np.full(3, float(joiner)))
    np.testing.assert_array_equal(rt.allreduce(np.ones(3), op=rt.Sum, name=f"{tag}.after.sum"), np.full(3, n))
