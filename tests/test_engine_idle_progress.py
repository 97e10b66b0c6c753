"""An engine pass that runs nothing makes one MPI call in a world whose MPI moves data only inside MPI calls, and
none in other worlds; checked single-process with stand-ins (the elastic and joined worlds that need it are in
test_elastic.py and test_launch_environment.py, whose waits also drive MPI and so cannot tell this half apart)."""
import threading

import pytest
from mpi4py import MPI

from ringtrain.engine.control import ControlChannel
from ringtrain.engine.engine import Engine
from ringtrain.engine.intake import Intake


class _Ctrl:
    """The engine's control communicator: counts the probes made on it."""

    def __init__(self):
        self.probes = []

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 2

    def Iprobe(self, source, tag):
        self.probes.append((source, tag))
        return False


class _IdleAgreement:
    """Nothing to agree on: every poll returns no action."""

    def poll(self, lazy=False):
        return []


class _Watchdog:
    abort_reason = None

    def check(self, what):
        pass


@pytest.mark.parametrize("drives_mpi", [True, False])
def test_an_idle_pass_probes_mpi_only_where_the_world_needs_it(drives_mpi):
    """In an elastic or joined world a rank whose engine has nothing to run still holds what it sent (the
    coordinator's answer, a root's broadcast) until its next MPI call: each idle pass makes one. A normal job's
    idle passes make none."""
    engine = Engine.__new__(Engine)          # no world: only what _pass reads
    engine.intake, engine.agreement, engine.watchdog = Intake(0, threading.Event()), _IdleAgreement(), _Watchdog()
    engine.control = ControlChannel(_Ctrl(), engine.watchdog, drives_mpi)
    for _ in range(3):
        assert engine._pass() is False
    assert engine.control.ctrl.probes == ([(MPI.ANY_SOURCE, MPI.ANY_TAG)] * 3 if drives_mpi else [])


def test_an_aborted_worlds_idle_pass_makes_no_mpi_call():
    """Once an elastic driver's word of a death aborted the world, progress() makes no MPI call on it: MPICH's ofi
    aborts the process when a probe meets the dead peer's completion error, whatever the error handler."""
    engine = Engine.__new__(Engine)
    engine.intake, engine.agreement, engine.watchdog = Intake(0, threading.Event()), _IdleAgreement(), _Watchdog()
    engine.control = ControlChannel(_Ctrl(), engine.watchdog, True)
    engine.watchdog.abort_reason = "worker w (rank 1) died"
    engine._pass()
    assert engine.control.ctrl.probes == []
