"""What a failed engine pass becomes, and the end of a process whose world can no longer finish a collective.

A pass can fail because a peer died or failed (the watchdog names it), because a peer never came (StallError), because
the caller was interrupted, or because of a bug in ringtrain itself; pass_failure() turns each into the error every
local handle gets and the announcement the peers get. The engine acts on it (engine.py: _pass_failed, _fail).
"""
import atexit
import logging
import os
import sys
import threading

from mpi4py import MPI

from ..errors import RankFailureError, RingtrainError, StallError

log = logging.getLogger("ringtrain")

DEAD_PEER_EXIT_GRACE_S = 5.0


class FailedIn(Exception):
    """Which collective a crash happened in (the crash itself is its __cause__)."""


def pass_failure(e, rank, size, watchdog):
    """(error, announcement) for what a pass raised: announcement None when a peer failed or died (nothing to tell
    the others: the error is theirs already), else the message every peer is sent before this engine stops."""
    if isinstance(e, (FailedIn, MPI.Exception)) and size > 1:
        # an MPI call can fail on a peer that was just killed before the watchdog's next look -- in a collective,
        # or in the agreement's own sends and probes (MPICH's ofi returns an error there): name the peer, not a
        # crash of this engine
        e = watchdog.peer_failure() or e
    if isinstance(e, RankFailureError):       # a peer died, failed, or this world was abandoned
        return e, None
    if isinstance(e, (KeyboardInterrupt, SystemExit)):
        error = RingtrainError(f"ringtrain engine on rank {rank} stopped: interrupted inside a collective ({e!r})")
        return error, str(error)
    if isinstance(e, StallError):          # a peer never came: the message says who
        return e, f"ringtrain engine on rank {rank} stopped: {e}"
    # a bug in ringtrain itself
    log.error("rank %d: ringtrain engine crashed", rank, exc_info=e)
    where, cause = (f" in {e}", e.__cause__) if isinstance(e, FailedIn) else ("", e)
    error = RingtrainError(f"ringtrain engine on rank {rank} crashed{where}: {cause!r}")
    return error, str(error)


_hard_exit_armed = False


def arm_hard_exit(grace):
    """End this process `grace` seconds from now (or at interpreter exit, whichever comes first) without
    MPI_Finalize: a world with a dead or failed peer cannot finish it."""
    global _hard_exit_armed
    if _hard_exit_armed:
        return
    _hard_exit_armed = True

    def _exit():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    timer = threading.Timer(grace, _exit)
    timer.daemon = True
    timer.start()
    # interpreter exit before the timer fires must not run MPI_Finalize against a dead peer either
    atexit.register(_exit)
