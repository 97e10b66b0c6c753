"""abandon(): leaving a world without another MPI call on it (what an elastic job does when a peer died), then
init() on a fresh communicator gives a working engine. Pending collectives end with RankFailureError at once."""
import numpy as np
import pytest
from mpi4py import MPI

import ringtrain as rt


@pytest.mark.mpi(min_size=2)
def test_abandon_ends_pending_work_and_a_new_world_works():
    rt.shutdown()
    rt.init(elastic=True)
    rt.allreduce(np.ones(2), name="abandon.warm")
    if rt.rank() == 0:       # a collective no peer will ever join: only abandon() can end it
        handle = rt.allreduce_async(np.ones(3), name="abandon.never")
        rt.core.state.abandon("the test abandons this world")
        with pytest.raises(rt.RankFailureError, match="the test abandons this world"):
            rt.synchronize(handle)
    else:
        rt.core.state.abandon("the test abandons this world")
    assert not rt.is_initialized()
    rt.core.state.abandon("again")                       # a no-op when not initialised
    fresh = MPI.COMM_WORLD.Dup()                    # the new world: the same processes here, a merged one elastically
    try:
        rt.init(comm=fresh)
        got = rt.allreduce(np.full(3, rt.rank() + 1.0), op=rt.Sum, name="abandon.after")
        np.testing.assert_array_equal(got, np.full(3, rt.size() * (rt.size() + 1) / 2))
    finally:
        rt.shutdown()
        rt.init()
