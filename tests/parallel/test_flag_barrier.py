"""FlagBarrier.on_node (cuda_ipc's syncs; shm runs the same class on its own window): after arrive(), every rank
sees every peer's writes from before it, round after round with skewed ranks; a rank that never arrives is named."""
import time

import numpy as np
import pytest
from mpi4py import MPI

from ringtrain.errors import StallError
from ringtrain.transports.flag_barrier import FlagBarrier
from ringtrain.engine.watchdog import Watchdog

pytestmark = pytest.mark.mpi(min_size=2)


@pytest.fixture
def comm():
    comm = MPI.COMM_WORLD.Dup()
    yield comm
    comm.Free()


def shared_board(comm):
    """One int64 per rank in node-shared memory: what each rank last wrote, readable by every rank."""
    win = MPI.Win.Allocate_shared(comm.Get_size() * 8 if comm.Get_rank() == 0 else 0, 8, comm=comm)
    mem, _ = win.Shared_query(0)
    return win, np.frombuffer(mem, dtype=np.int64)[: comm.Get_size()]


def test_every_rank_sees_every_write_from_before_the_barrier(comm):
    barrier = FlagBarrier.on_node(comm, Watchdog(), 30.0, "test")
    win, board = shared_board(comm)
    win.Lock_all(MPI.MODE_NOCHECK)
    rank, size = comm.Get_rank(), comm.Get_size()
    try:
        for round_ in range(1, 41):
            if round_ % 8 == rank % 8:
                time.sleep(0.005)            # a late rank: a barrier that does not wait lets peers read too early
            board[rank] = round_ * size + rank
            barrier.arrive(f"write {round_}")
            np.testing.assert_array_equal(board, round_ * size + np.arange(size))
            barrier.arrive(f"read {round_}")  # nobody writes the next round before everyone has read this one
        assert barrier.count == 80
    finally:
        win.Unlock_all()
        win.Free()
        barrier.free()


def test_a_rank_that_never_arrives_is_named(comm):
    barrier = FlagBarrier.on_node(comm, Watchdog(), 1.0, "test")
    absent = comm.Get_size() - 1
    try:
        if comm.Get_rank() == absent:
            time.sleep(2.0)                  # past the others' timeout: they must give up and name this rank
        else:
            with pytest.raises(StallError, match=rf"ranks \[{absent}\] did not reach test lonely"):
                barrier.arrive("lonely")
    finally:
        comm.Barrier()
        barrier.free()
