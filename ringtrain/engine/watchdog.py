"""Bounded, interruptible waiting: every blocking wait in ringtrain goes through here so nothing hangs.

A wait polls (MPI requests, shared-memory flags, CUDA events) with a short sleep that backs off, and every
`peer_check_s` asks the Watchdog whether a peer process on this node has died or the engine was aborted.
Spinning hard would steal the core the training thread needs on small machines, hence the backoff -- except for
the thread that called a synchronous collective on a machine with a core per rank: it has nothing else to do, so
it polls (with sched_yield) for up to CALLER_YIELD_S, as MPI's own blocking calls do, instead of adding an OS
wake-up to every step.
"""
import os
import threading
import time
import weakref

from ..errors import RankFailureError

YIELD_S = 2e-4     # how long a wait polls with sched_yield before it starts sleeping
SPIN_POLLS = 64    # polls without yielding first -- only while this machine has a core for every rank on it
# How long the thread that called a synchronous collective keeps polling with sched_yield, while this machine has a
# core for every rank on it: that thread has nothing else to do, and its core no other rank needs, so an OS sleep
# would only add its wake-up (up to the 1 ms backoff) to the step once the slowest rank arrives -- as MPI's own
# barrier, which polls the whole time. The engine's background thread never does: with overlap it shares its core
# with the training thread.
CALLER_YIELD_S = 0.05
# Then sleeps, each a share of the time waited so far: the first few are as short as the OS allows (~60 us for a
# 20 us request), so a peer arriving within the first millisecond or so is seen within ~100 us of its publish,
# and a longer wait costs at most ~1/SLEEP_SHARE more than itself -- up to SLEEP_CAP_S, which bounds the wake-ups
# of a long wait (a stalled peer) to ~2000 a second. (A sleep as long as the polls made so far in microseconds,
# as before, started at ~1 ms right after the yields: every late peer cost up to a millisecond more.)
SLEEP_MIN_S = 2e-5
SLEEP_SHARE = 1 / 32
SLEEP_CAP_S = 5e-4
ENGINE_THREAD = "ringtrain-engine"     # the name of the engine's background thread


_live = weakref.WeakSet()     # every Watchdog not yet garbage: abort_all() reaches the engines of every world


def abort_all(reason):
    """From any thread: every wait of every engine in this process (process sets included) ends with
    RankFailureError(reason). ringtrain.elastic calls it when its driver reports a dead worker: the world's
    collectives can never complete, and a stopped world's engines ignore it."""
    for watchdog in list(_live):
        watchdog.abort_reason = reason


def _alive(pid):
    """True while the process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True


class Watchdog:
    """Knows the pids of the ranks on this node; check() raises RankFailureError naming a dead one."""

    def __init__(self, local_peers=None, peer_check_s=0.5):
        self.local_peers = dict(local_peers or {})   # world rank -> pid, same host only
        self.peer_check_s = peer_check_s
        self.abort_reason = None                     # set by the engine to break every wait
        # called while waiting: the engine tests its outstanding control-message sends here, because MPI only
        # moves a large (rendezvous) message while the sender calls into MPI, and a wait on shared-memory flags
        # makes no MPI call -- without this, rank 0 could wait in a barrier for a peer that is still waiting for
        # the very message that tells it to join that barrier
        self.progress = None
        # called every peer_check_s: a peer's own word that its engine failed (None while there is none). A
        # crashed engine's process is alive, so the pid check cannot see it, and its peers may be waiting for it
        # anywhere: in an agreement cycle, a shared-memory barrier, an MPI request
        self.failed_peer = None
        self._next_check = 0.0
        # With more ranks on this machine than cores a busy poll only burns the time slice the peer we wait for
        # needs: yield from the first poll (4 ranks on 2 cores: 4 KB shm allreduce 122 -> 92-106 us).
        ranks_here = len(self.local_peers) + 1
        self.core_per_rank = ranks_here <= len(os.sched_getaffinity(0))
        self.spin_polls = SPIN_POLLS if self.core_per_rank else 0
        _live.add(self)

    def yield_s(self):
        """How long the calling thread's waits poll with sched_yield before they sleep."""
        if self.core_per_rank and threading.current_thread().name != ENGINE_THREAD:
            return max(YIELD_S, CALLER_YIELD_S)
        return YIELD_S

    def check_sendable(self, what=""):
        """Before point-to-point sends: raise RankFailureError once this world was aborted (an elastic driver's
        word that a worker died). A send to a peer whose connection MPICH has seen fail crashes the process --
        MPICH's ch4 isend writes to the request it failed to create (SIGSEGV in MPI_Isend, whatever the error
        handler) -- so no send may follow the abort, even on a thread that never waits."""
        if self.abort_reason is not None:
            raise RankFailureError(f"{self.abort_reason}" + (f" (while waiting for {what})" if what else ""))

    def check(self, what=""):
        self.check_sendable(what)
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + self.peer_check_s
        if self.failed_peer is not None:
            message = self.failed_peer()
            if message is not None:
                raise RankFailureError(message + (f" (while this rank waited for {what})" if what else ""))
        for rank, pid in self.local_peers.items():
            if not _alive(pid):
                raise RankFailureError(
                    f"rank {rank} (pid {pid}) has died" + (f" while this rank waited for {what}" if what else ""))

    def peer_failure(self, grace_s=0.25):
        """The dead or failed peer behind an unexplained error, as check() would name it, or None. An MPI call to a
        peer that was just killed can fail before this rank's next periodic check: look at once, then for up to
        grace_s while the peer's death reaches /proc or its announcement arrives."""
        deadline = time.monotonic() + grace_s
        while True:
            self._next_check = 0.0
            try:
                self.check()
            except RankFailureError as failure:
                return failure
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.01)

    def wait(self, done, what="", timeout=None):
        """Poll done() until it returns true: a short busy spin, then polls that yield the CPU for YIELD_S (on an
        oversubscribed machine the peer we wait for may need this very core; see yield_s() for the caller of a
        synchronous collective), then sleeps of a share of the time waited so far, from the shortest the OS gives to
        SLEEP_CAP_S (an OS sleep costs ~60 us of latency, so it comes last). Peers are checked meanwhile.
        Raise RankFailureError on a dead peer, TimeoutError after `timeout` seconds."""
        spins = 0
        start = time.monotonic()
        spin_polls = self.spin_polls
        yield_s = None
        while not done():
            spins += 1
            if spins < spin_polls:
                continue
            if yield_s is None:
                yield_s = self.yield_s()
            waited = time.monotonic() - start
            if waited < yield_s:
                os.sched_yield()
                if waited > YIELD_S:     # a long poll (the caller's) does what the sleeping one does between polls
                    self.check(what)
                    if self.progress is not None:
                        self.progress()
                continue
            self.check(what)
            if self.progress is not None:
                self.progress()
            time.sleep(min(SLEEP_CAP_S, max(SLEEP_MIN_S, waited * SLEEP_SHARE)))
            if timeout is not None and time.monotonic() - start > timeout:
                raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")

    def wait_for_all(self, peers, arrived, what, timeout):
        """Wait until arrived(p) holds for every p in peers -- a barrier on flags in shared memory. Each poll reads
        only the peers still missing (scalar reads, ~0.1 us each). Returns None, or after `timeout` seconds the
        sorted list of peers that never arrived, for the caller's StallError."""
        waiting = list(peers)

        def everyone_arrived():
            while waiting:
                if not arrived(waiting[-1]):
                    return False
                waiting.pop()
            return True

        try:
            self.wait(everyone_arrived, what, timeout=timeout)
        except TimeoutError:
            # the poll stops at the first missing peer, so the others still listed may have arrived meanwhile
            return sorted(p for p in waiting if not arrived(p))
        return None

    def wait_requests(self, requests, what=""):
        """Wait for a list of mpi4py requests without blocking inside MPI."""
        from mpi4py import MPI  # noqa: imported lazily so CPU-free layers never pull MPI in at import time
        pending = [r for r in requests if r != MPI.REQUEST_NULL]
        if not pending:
            return
        self.wait(lambda: MPI.Request.Testall(pending), what)
