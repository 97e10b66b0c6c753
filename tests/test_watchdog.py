"""The Watchdog against real processes: a peer that exited (reaped or still a zombie) is found and named; a live one
is not; a wait on a dead peer ends with RankFailureError instead of running into its timeout."""
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from ringtrain.engine import watchdog as watchdog_module
from ringtrain.errors import RankFailureError
from ringtrain.engine.watchdog import Watchdog


@pytest.fixture
def sleeper():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def exited_child(reap):
    """A child that has exited; reap=False leaves it a zombie (exited, not yet waited for) as a crashed peer
    whose parent (the MPI process manager) has not collected it yet."""
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    if reap:
        assert proc.wait(timeout=30) == 3
    else:
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)     # wait for the exit, leave the zombie
    return proc


@pytest.mark.parametrize("reap", [True, False], ids=["reaped", "zombie"])
def test_an_exited_peer_is_named(sleeper, reap):
    dead = exited_child(reap)
    try:
        watchdog = Watchdog({1: sleeper.pid, 2: dead.pid}, peer_check_s=0.0)
        with pytest.raises(RankFailureError, match=rf"rank 2 \(pid {dead.pid}\) has died while this rank waited "
                                                   r"for the bucket"):
            watchdog.check("the bucket")
    finally:
        dead.wait()


def test_live_peers_pass_until_one_is_killed(sleeper):
    watchdog = Watchdog({0: os.getpid(), 3: sleeper.pid}, peer_check_s=0.0)
    watchdog.check("anything")                  # both alive: no error
    sleeper.kill()
    sleeper.wait()
    with pytest.raises(RankFailureError, match=rf"rank 3 \(pid {sleeper.pid}\) has died"):
        watchdog.check("anything")


def test_a_wait_on_a_dead_peer_ends_long_before_its_timeout():
    dead = exited_child(reap=True)
    watchdog = Watchdog({1: dead.pid}, peer_check_s=0.05)
    start = time.monotonic()
    with pytest.raises(RankFailureError, match=rf"rank 1 \(pid {dead.pid}\) has died"):
        watchdog.wait(lambda: False, "a message from rank 1", timeout=60)
    assert time.monotonic() - start < 10


def test_a_wait_that_completes_raises_nothing_and_an_abort_ends_any_wait(sleeper):
    watchdog = Watchdog({1: sleeper.pid}, peer_check_s=0.0)
    polls = iter(range(200))
    watchdog.wait(lambda: next(polls) >= 100, "a flag")           # past the spin phase, into the checks
    watchdog.abort_reason = "the engine stopped"
    with pytest.raises(RankFailureError, match="the engine stopped"):
        watchdog.wait(lambda: False, "a flag", timeout=60)


def test_only_a_caller_with_a_core_per_rank_polls_long(monkeypatch, sleeper):
    """The thread that called a synchronous collective polls (sched_yield) instead of sleeping while every rank has
    a core; the engine's own thread, and every thread of an oversubscribed machine, sleep after YIELD_S."""
    monkeypatch.setattr(watchdog_module.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    one_peer = Watchdog({1: sleeper.pid})                      # 2 ranks on 2 cores
    assert one_peer.yield_s() == watchdog_module.CALLER_YIELD_S > watchdog_module.YIELD_S
    seen = []
    engine = threading.Thread(target=lambda: seen.append(one_peer.yield_s()), name=watchdog_module.ENGINE_THREAD)
    engine.start()
    engine.join()
    assert seen == [watchdog_module.YIELD_S]
    three_peers = Watchdog({1: sleeper.pid, 2: sleeper.pid, 3: sleeper.pid})     # 4 ranks on 2 cores
    assert three_peers.yield_s() == watchdog_module.YIELD_S


def test_a_long_poll_keeps_checking_peers_and_moving_messages(monkeypatch, sleeper):
    """While the caller polls, a dead peer still ends the wait within peer_check_s, and the engine's control
    messages keep moving (Watchdog.progress), as between the sleeps of a short poll."""
    monkeypatch.setattr(watchdog_module, "CALLER_YIELD_S", 30.0)
    monkeypatch.setattr(watchdog_module.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    dead = exited_child(reap=True)
    watchdog = Watchdog({1: dead.pid}, peer_check_s=0.05)
    assert watchdog.yield_s() == 30.0
    start = time.monotonic()
    with pytest.raises(RankFailureError, match=rf"rank 1 \(pid {dead.pid}\) has died"):
        watchdog.wait(lambda: False, "a flag", timeout=60)
    assert time.monotonic() - start < 5
    moved = []
    watchdog = Watchdog({1: sleeper.pid}, peer_check_s=0.05)
    watchdog.progress = lambda: moved.append(1)
    start = time.monotonic()
    watchdog.wait(lambda: len(moved) >= 3, "a message that needs progress")
    assert time.monotonic() - start < 5


def test_peer_failure_looks_at_once_and_through_its_grace_for_a_peer_dying_now(sleeper):
    """After an MPI call failed on a peer that was just killed, the engine asks peer_failure() for the cause: it
    must look now, not at the next periodic check (peer_check_s far away here), and keep looking for its grace
    while the peer is still on its way out."""
    watchdog = Watchdog({1: sleeper.pid}, peer_check_s=3600.0)
    watchdog.check()                                    # the periodic check ran: the next is an hour away
    start = time.monotonic()
    assert watchdog.peer_failure(grace_s=0.2) is None   # a live peer is no explanation
    assert 0.2 <= time.monotonic() - start < 2.0
    threading.Timer(0.05, sleeper.kill).start()         # dies during the grace
    failure = watchdog.peer_failure(grace_s=5.0)
    assert isinstance(failure, RankFailureError)
    assert f"rank 1 (pid {sleeper.pid}) has died" in str(failure)


def test_an_aborted_world_sends_no_agreement_message():
    """After the driver's word of a death (abort_reason), a rank that follows a peer into an agreement cycle raises
    before it fills or sends its slot: a send to a peer MPICH saw die crashes the sender (Watchdog.check_sendable)."""
    from mpi4py import MPI

    from ringtrain.config import Config
    from ringtrain.engine.cycle_exchange import MessageExchange

    comm = MPI.COMM_SELF.Dup()
    watchdog = Watchdog()
    copies = []
    exchange = MessageExchange(comm, Config(), watchdog, 1, 64, lambda view, array: copies.append(array))
    try:
        watchdog.abort_reason = "worker localhost[1] (rank 1) died"
        with pytest.raises(RankFailureError, match=r"rank 1\) died \(while waiting for agreement cycle 1\)"):
            exchange.publish(1, 0, 1, 1, (0, np.ones(4, np.float32)))
        assert copies == []                         # nothing was written into a slot either
    finally:
        exchange.close()
        comm.Free()


def test_a_sleeping_wait_sleeps_a_share_of_the_time_waited(monkeypatch, sleeper):
    """After its polls a wait sleeps, but each sleep is short against the time already waited (from ~20 us up to
    SLEEP_CAP_S): a peer that arrives a millisecond into the wait is seen within ~100 us, not a whole
    millisecond-long sleep later. (The yields are made free here, as on an idle core: many polls in YIELD_S.)"""
    monkeypatch.setattr(watchdog_module.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    monkeypatch.setattr(watchdog_module.os, "sched_yield", lambda: None)
    sleeps = []
    clock = time.monotonic

    def recording_sleep(seconds):
        sleeps.append((clock() - start, seconds))
        time.sleep(seconds)
    monkeypatch.setattr(watchdog_module, "time", type("T", (), {"monotonic": staticmethod(clock),
                                                               "sleep": staticmethod(recording_sleep)}))
    watchdog = Watchdog({1: sleeper.pid})                       # 2 ranks on 1 core: sleeps after YIELD_S
    start = clock()
    # a long wait: 40 ms, and until a sleep began past 16 ms waited (a loaded machine can deschedule this process
    # past the 40 ms before the wait slept that late); 2 s at most
    watchdog.wait(lambda: clock() - start > 2.0 or (clock() - start > 0.04 and any(w > 0.016 for w, _ in sleeps)),
                  "a late peer")
    assert sleeps and sleeps[0][0] >= watchdog_module.YIELD_S * 0.99
    for waited, seconds in sleeps:
        assert seconds <= watchdog_module.SLEEP_CAP_S <= 1e-3, (waited, seconds)
        assert seconds <= max(watchdog_module.SLEEP_MIN_S, waited / 16), (waited, seconds, sleeps[:5])
    assert max(s for _, s in sleeps) == watchdog_module.SLEEP_CAP_S     # a long wait backs off to the cap
