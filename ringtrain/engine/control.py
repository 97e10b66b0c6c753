"""The engine's control messages: how the agreement's submissions reach rank 0's Coordinator and its answers come
back, and how a failing engine tells its peers -- on the engine's own communicator, never a blocking send.

What the messages say (and what the ranks decide from them) is the agreement's (agreement.py); this module only
moves them, keeps the outstanding sends moving, and probes MPI where the world's MPI moves data only inside MPI
calls (progress()).
"""
import logging
import time

from mpi4py import MPI

log = logging.getLogger("ringtrain")

TAG_TO_COORDINATOR = 11
TAG_FROM_COORDINATOR = 12
TAG_FAILURE = 14            # "my engine failed": every peer ends its waits and its engine on it
ANNOUNCE_S = 2.0            # how long a failing rank waits for its peers to take its failure message (each
                            # looks every peer_check_s, 0.5 s by default, wherever it waits or idles)


class ControlChannel:
    """Nonblocking sends and probed receives of the engine's control messages on `ctrl`."""

    def __init__(self, ctrl, watchdog, drives_mpi):
        self.ctrl, self.watchdog = ctrl, watchdog
        self.rank, self.size = ctrl.Get_rank(), ctrl.Get_size()
        self.drives_mpi = drives_mpi     # see progress()
        self._sends = []                 # outstanding isends on ctrl

    def send(self, message, dest, tag):
        # never a blocking send: the destination may be busy in a ring step that needs us
        self.watchdog.check_sendable()
        self._sends.append(self.ctrl.isend(message, dest=dest, tag=tag))

    def receive(self, tag, source=MPI.ANY_SOURCE):
        """(source, message) of one message with `tag` that has arrived, or None."""
        status = MPI.Status()
        if not self.ctrl.iprobe(source=source, tag=tag, status=status):
            return None
        source = status.Get_source()
        return source, self.ctrl.recv(source=source, tag=tag)

    def progress_sends(self):
        """Test outstanding sends: MPI moves a large (rendezvous) message only while the sender calls into MPI."""
        if self._sends:
            self._sends = [r for r in self._sends if not r.Test()]

    def progress(self):
        """What every wait calls between polls (Watchdog.progress): progress_sends, and in a world whose MPI
        progresses only inside MPI calls (drives_mpi) one Iprobe, so MPI moves what this rank already handed to it.

        A world joined from separately started processes (elastic, torchrun-style) is made of dynamic processes: every
        message between them, on one node too, goes through MPICH's network module, and ofi moves data only while the
        process calls into MPI (init() sets config.drive_mpi_progress for such worlds). A request can be
        complete here while its data has not left: the root of a broadcast, a ring step's send, the coordinator's
        answer. A rank that then waits on shared memory (a cycle in the window, the shm transport) or sleeps would
        leave its peers waiting until its next MPI call -- the Watchdog's peer check, every peer_check_s."""
        if self.watchdog.abort_reason is not None:
            return      # the world was aborted (an elastic driver's word of a death): no more MPI calls on it --
            #             MPICH's ofi aborts the process when a poll meets a dead peer's completion error
        self.progress_sends()
        if self.drives_mpi:
            self.ctrl.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)

    def announce_failure(self, message):
        """Tell every peer this rank's engine failed (best effort: this rank is failing, MPI may be too). A
        synchronous send, waited for up to ANNOUNCE_S: a plain send may complete while the message still sits in
        this process, and the caller may end the process right after."""
        try:
            sends = [self.ctrl.issend(message, dest=p, tag=TAG_FAILURE) for p in range(self.size) if p != self.rank]
            deadline = time.monotonic() + ANNOUNCE_S
            while sends and time.monotonic() < deadline:
                sends = [r for r in sends if not r.Test()]
                time.sleep(1e-3)
        except Exception:
            log.debug("rank %d: could not announce the engine failure", self.rank, exc_info=True)

    def failed_peer(self):
        """A peer's failure announcement, or None (the Watchdog asks every peer_check_s, wherever this rank waits)."""
        received = self.receive(TAG_FAILURE)
        return None if received is None else received[1]
