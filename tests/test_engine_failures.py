"""What an engine's failed pass becomes, and which sends a world's abort stops, checked single-process with
stand-ins for the peers (the real deaths are in test_elastic.py and the fault tests)."""
import numpy as np
import pytest
from mpi4py import MPI

from ringtrain.engine.engine import Engine
from ringtrain.errors import RankFailureError, RingtrainError
from ringtrain.transports.mpi_util import NonblockingBroadcastAlltoall, WireTypes
from ringtrain.engine.watchdog import Watchdog


class _Peers:
    """The engine's view of its peers: peer_failure() names rank 1 as dead, or nothing."""

    def __init__(self, dead):
        self.dead = dead

    def peer_failure(self):
        return RankFailureError("rank 1 (pid 4242) has died") if self.dead else None


class _Control:
    def __init__(self):
        self.announced = []

    def announce_failure(self, message):
        self.announced.append(message)


def _engine(dead_peer):
    engine = Engine.__new__(Engine)          # no world: only what _pass_failed reads
    engine.rank, engine.size = 0, 2
    engine.watchdog, engine.control = _Peers(dead_peer), _Control()
    engine.failures = []
    engine._fail = lambda error, **how: engine.failures.append((error, how))
    return engine


def test_an_mpi_error_in_the_agreement_names_the_peer_that_died():
    """MPICH's ofi returns an error from a send or probe towards a peer that was just killed: the engine's failure
    names that peer (as a dead peer's), not a crash of this engine."""
    engine = _engine(dead_peer=True)
    engine._pass_failed(MPI.Exception(MPI.ERR_OTHER))
    [(error, how)] = engine.failures
    assert isinstance(error, RankFailureError) and "rank 1 (pid 4242) has died" in str(error)
    assert how == {"fatal_peer": True} and engine.control.announced == []


def test_an_mpi_error_with_every_peer_alive_is_a_crash_of_this_engine():
    engine = _engine(dead_peer=False)
    engine._pass_failed(MPI.Exception(MPI.ERR_OTHER))
    [(error, how)] = engine.failures
    assert type(error) is RingtrainError and "crashed" in str(error) and how["stop"]
    assert len(engine.control.announced) == 1


class _NoMPI:
    """A communicator of two ranks on which every MPI call is a test failure."""

    def Get_size(self):
        return 2

    def Get_rank(self):
        return 0

    def __getattr__(self, name):
        raise AssertionError(f"MPI {name} called after the world was aborted")


class _Transport(NonblockingBroadcastAlltoall):
    def __init__(self, watchdog):
        self.comm, self.size, self.watchdog = _NoMPI(), 2, watchdog
        self._wire, self._limit = WireTypes(), 1 << 20


@pytest.mark.parametrize("collective", ["broadcast", "alltoall"])
def test_no_broadcast_or_alltoall_starts_after_the_world_was_aborted(collective):
    """An elastic driver's word of a death aborts the world: a broadcast or alltoall agreed just before must not
    start its sends towards the dead worker (MPICH's ucx crashed the sender there)."""
    watchdog = Watchdog()
    watchdog.abort_reason = "worker 3 died"
    transport = _Transport(watchdog)
    data = np.zeros(4, np.float32)
    with pytest.raises(RankFailureError, match="worker 3 died"):
        if collective == "broadcast":
            transport.broadcast(data, root=0)
        else:
            transport.alltoall(data, [2, 2], np.zeros(4, np.float32), [2, 2])
