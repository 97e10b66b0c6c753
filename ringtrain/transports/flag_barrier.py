"""A barrier of the ranks of one node on sequence numbers in shared memory -- no MPI call on the way.

    barrier = FlagBarrier.on_node(comm, watchdog, config.stall_timeout_s, "cuda_ipc")
    barrier.arrive("allgather")        # returns once every rank of comm has arrived at its same-numbered sync
    barrier.free()                     # collective

Each rank owns one cache line (so ranks never write the same line) holding a sequence number that only grows.
Arriving is "bump mine, wait until every rank's is >= mine". Why that is a barrier even back to back: a rank can
only bump past n + 1 after it saw every rank at n + 1, so nobody waits on a number a peer already overwrote,
and a number never goes down. Win.Sync before the bump orders this rank's earlier writes to shared memory
(or, for cuda_ipc, its drained stream's results) before the flag; Win.Sync after the wait orders peers' writes
before whatever this rank reads next.

The wait is the Watchdog's (spin, yield, then backed-off sleeps; a dead peer is named). A rank missing for
`timeout_s` raises StallError naming it: ranks that disagree on the sequence of collectives end with an error,
not a hang. The shm transport keeps its lines in its own window (with data offsets and signatures beside the
sequence number) and hands them in; other transports allocate a small window of their own with on_node().
"""
import numpy as np
from mpi4py import MPI

from ..errors import StallError
from .mpi_util import one_node_comm

LINE = 64                      # bytes of flags per rank: one cache line
LINE_INT64 = LINE // 8


class FlagBarrier:
    def __init__(self, seqs, rank, win, watchdog, timeout_s, label):
        """seqs: int64 view with one sequence number per rank (in shared memory, zero at start);
        win: the MPI window seqs lives in (for Win.Sync)."""
        self._seqs = seqs
        self._rank = rank
        self._peers = [p for p in range(len(seqs)) if p != rank]
        self._win = win
        self._watchdog = watchdog
        self._timeout_s = timeout_s
        self._label = label
        self._seq = 0
        self._owned = None             # (window, node communicator) when on_node() allocated them

    @classmethod
    def on_node(cls, comm, watchdog, timeout_s, label):
        """Collective over comm, whose ranks must all share one node: a window of one line per rank."""
        node = one_node_comm(comm, label)
        size = comm.Get_size()
        win = MPI.Win.Allocate_shared(size * LINE if node.Get_rank() == 0 else 0, 1, comm=node)
        win.Lock_all(MPI.MODE_NOCHECK)      # one passive epoch for the window's lifetime: Win.Sync is legal
        mem, _ = win.Shared_query(0)
        lines = np.frombuffer(mem, dtype=np.int64)[: size * LINE_INT64].reshape(size, LINE_INT64)
        rank = node.Get_rank()              # == comm's rank: key=rank keeps the order
        lines[rank, :] = 0                  # MPI does not zero the window; each rank clears its own line
        win.Sync()
        node.Barrier()
        win.Sync()
        barrier = cls(lines[:, 0], rank, win, watchdog, timeout_s, label)
        barrier._owned = (win, node)
        return barrier

    @property
    def count(self):
        """How many times this rank has arrived."""
        return self._seq

    def arrive(self, what):
        self._seq += 1
        target = self._seq
        self._win.Sync()
        self._seqs[self._rank] = target
        seqs = self._seqs
        missing = self._watchdog.wait_for_all(self._peers, lambda p: seqs[p] >= target,
                                              f"{self._label} {what} (rank {self._rank}, sync {target})",
                                              self._timeout_s)
        if missing:
            raise StallError(f"rank {self._rank}: ranks {missing} did not reach {self._label} {what} (sync "
                             f"{target}) within {self._timeout_s:g} s; the ranks are not running the same sequence "
                             f"of collectives on this transport")
        self._win.Sync()

    def free(self):
        """Collective, for a barrier from on_node()."""
        if self._owned is None:
            return
        win, node = self._owned
        self._owned = self._seqs = None
        win.Unlock_all()
        win.Free()
        node.Free()
