"""The express path (Engine.express): a synchronous small allreduce, cached, with nothing else in flight, runs as one
agreement cycle on the caller's thread with no request or handle. When that cycle's snapshot says anything else --
a peer is not there yet, a peer flagged the cycle, a peer published other eager data -- the call must become an
ordinary request and still end with the right result on every rank."""
import time

import numpy as np
import pytest
from mpi4py import MPI

import ringtrain as rt
from ringtrain.core import state

pytestmark = pytest.mark.mpi(min_size=2)


def inputs(n, salt):
    return [(np.arange(n) % 7 + 3 * r + salt).astype(np.float32) for r in range(rt.size())]


@pytest.fixture
def fallbacks(monkeypatch):
    """Names of the express calls on this rank that became ordinary requests."""
    eng = state.engine()
    made = []
    original = eng._express_request

    def spy(name, *args):
        made.append(name)
        return original(name, *args)
    monkeypatch.setattr(eng, "_express_request", spy)
    return made


@pytest.fixture
def outcomes(monkeypatch):
    """(name, outcome) of every express cycle on this rank: "eager" (reduced from the slots; True: by the native cycle), "agreed" (ran the
    transport itself), "request" (became an ordinary request), None (did not apply)."""
    from ringtrain.engine.model import Collective, Source
    agreement = state.engine().agreement
    seen = []
    original = agreement.express

    def spy(name, *args):
        outcome = original(name, *args)
        kind = ("eager" if outcome is True or isinstance(outcome, Collective) and outcome.source is Source.SLOTS
                else "agreed" if isinstance(outcome, Collective) else None if outcome is None
                else "request")
        seen.append((name, kind))
        return outcome
    monkeypatch.setattr(agreement, "express", spy)
    return seen


def test_a_cached_small_allreduce_completes_in_its_own_cycle(fallbacks):
    x = inputs(100, 1)
    want_sum, want_avg = sum(x), sum(x) / rt.size()
    for call in range(20):
        out = rt.allreduce(x[rt.rank()], op=rt.Sum, name="express.sum")
        np.testing.assert_array_equal(out, want_sum, err_msg=f"call {call}")
        inplace = x[rt.rank()].copy()
        rt.allreduce(inplace, name="express.avg", out=inplace, postscale_factor=2.0)
        np.testing.assert_allclose(inplace, 2.0 * want_avg, rtol=1e-6, err_msg=f"call {call}")
    assert not state.engine().requests
    # the shutdown summary counts express calls with their real duration
    recorded = state.engine().stats.local()["allreduce"]
    assert recorded["count"] >= 40 and min(recorded["samples"]) > 0, recorded
    # 40 calls, 2 first sightings: after them every call is express (a peer's idle engine thread may join a cycle
    # early and force one fallback now and then, not dozens)
    assert len(fallbacks) <= 6, f"rank {rt.rank()}: {len(fallbacks)} of 38 cached calls left the express path"


def test_a_late_peer_is_waited_for(fallbacks):
    """Every rank but the last calls at once; the last arrives 0.3 s later. The early ranks' express cycle either
    waits for it or (when the late rank's idle engine thread joins that cycle first) becomes a request: the same
    result either way."""
    x = inputs(257, 2)
    late = rt.rank() == rt.size() - 1
    rt.allreduce(x[rt.rank()], op=rt.Sum, name="express.late")       # first sighting: cached from now on
    for call in range(3):
        rt.barrier()
        if late:
            time.sleep(0.3)
        out = rt.allreduce(x[rt.rank()], op=rt.Sum, name="express.late")
        np.testing.assert_array_equal(out, sum(x), err_msg=f"call {call}")
    assert not state.engine().requests


@pytest.mark.parametrize("pause", [0.3, 0.0], ids=["bit_later", "bit_in_the_flagged_cycle"])
def test_a_peer_with_a_new_tensor_in_flight_flags_the_express_cycle(fallbacks, monkeypatch, pause):
    """The last rank first submits a never-seen tensor (a slow cycle through the coordinator) and then the cached
    one the others call -- 0.3 s later, so the others' express cycle sees its flag and misses its bit; or at once
    (its engine thread kept asleep), so one slot carries the flag AND the bit, and still no rank may run that id
    from its express cycle: the flagged cycle goes to the coordinator everywhere. Both reduce correctly."""
    x, fresh = inputs(64, 3), inputs(5, 4)
    late = rt.rank() == rt.size() - 1
    cached = f"express.flagged.{pause}"
    rt.allreduce(x[rt.rank()], op=rt.Sum, name=cached)
    if late and not pause:   # both requests then go into one cycle of the caller's own pass
        monkeypatch.setattr(state.engine().wake, "set", lambda: None)
    for call in range(3):
        rt.barrier()
        name = f"express.fresh.{pause}.{call}"
        if late:
            handle = rt.allreduce_async(fresh[rt.rank()], op=rt.Sum, name=name)
            time.sleep(pause)
            out = rt.allreduce(x[rt.rank()], op=rt.Sum, name=cached)
            other = handle.wait()
        else:
            out = rt.allreduce(x[rt.rank()], op=rt.Sum, name=cached)
            other = rt.allreduce(fresh[rt.rank()], op=rt.Sum, name=name)
        np.testing.assert_array_equal(out, sum(x), err_msg=f"call {call}")
        np.testing.assert_array_equal(other, sum(fresh), err_msg=f"call {call}")
    if pause and not late:
        assert fallbacks.count(cached) == 3, fallbacks
    assert not state.engine().requests


def test_a_peer_publishing_other_eager_data_sends_the_call_through_the_transport(outcomes):
    """The last rank has another small cached allreduce in flight (with the lower cache id, so its data is what it
    publishes) when it calls the one the others call: no rank may reduce the slots eagerly for that cycle. The
    others run the transport straight from their express cycle; the last rank runs the one action its general
    path computes from the same snapshot."""
    first, second = inputs(33, 5), inputs(48, 6)
    late = rt.rank() == rt.size() - 1
    rt.allreduce(first[rt.rank()], op=rt.Sum, name="express.lower_id")       # cached first: the lower id
    rt.allreduce(second[rt.rank()], op=rt.Sum, name="express.higher_id")
    for call in range(3):
        rt.barrier()
        if late:
            handle = rt.allreduce_async(first[rt.rank()], op=rt.Sum, name="express.lower_id")
            out = rt.allreduce(second[rt.rank()], op=rt.Sum, name="express.higher_id")
            low = handle.wait()
        else:
            time.sleep(0.3)
            out = rt.allreduce(second[rt.rank()], op=rt.Sum, name="express.higher_id")
            low = rt.allreduce(first[rt.rank()], op=rt.Sum, name="express.lower_id")
        np.testing.assert_array_equal(out, sum(second), err_msg=f"call {call}")
        np.testing.assert_array_equal(low, sum(first), err_msg=f"call {call}")
    if not late:
        # never reduced from the slots: the late rank's slot held the other tensor's data
        assert ("express.higher_id", "eager") not in outcomes, outcomes
    assert not state.engine().requests


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32])
def test_allreduces_at_the_eager_limit_and_past_it(dtype):
    """On one node allreduces up to window_eager_bytes(N) travel in the cycle's slots (megabytes, not just small
    ones); one element more takes the transport. Both sides of the limit, cached, averaged: equal to numpy."""
    from ringtrain.engine.agreement import window_eager_bytes
    itemsize = np.dtype(dtype).itemsize
    limit = window_eager_bytes(rt.size()) // itemsize
    for n in (limit, limit + 1, limit // 3):
        x = [((np.arange(n) * 13 + 5 * r) % 101).astype(dtype) for r in range(rt.size())]
        want = sum(a.astype(np.float64) for a in x) / rt.size()
        if np.issubdtype(dtype, np.integer):
            want = np.trunc(want)
        for call in range(3):                    # first sighting, then cached
            out = rt.allreduce(x[rt.rank()], name=f"express.limit.{np.dtype(dtype).name}.{n}")
            np.testing.assert_allclose(out.astype(np.float64), want, rtol=1e-6, err_msg=f"n={n}, call {call}")


def test_past_the_slots_the_express_cycle_runs_the_transport(outcomes, monkeypatch):
    """Too large for a slot (or in the shm window and past SHARED_EAGER_BYTES), a cached allreduce still takes one
    express cycle and then the transport call on this thread: no request, no handle. Private and in-window
    arrays, in place and not, Sum and Average: equal to numpy."""
    from ringtrain.engine.agreement import window_eager_bytes
    eng = state.engine()
    ran = []
    real = eng.executor.allreduce_one
    monkeypatch.setattr(eng.executor, "allreduce_one", lambda *a: ran.append(a[0].nbytes) or real(*a))
    n = window_eager_bytes(rt.size()) // 4 + 1 + 1000 * rt.size()
    x = inputs(n, 7)
    shared = rt.empty_shared(n, np.float32)
    call = 0

    def none_agreed():          # (every rank decides alike)
        return MPI.COMM_WORLD.allreduce("agreed" not in [kind for _, kind in outcomes], op=MPI.LOR)
    while call < 6 or (call < 24 and none_agreed()):
        out = rt.allreduce(x[rt.rank()], op=rt.Sum, name="express.large")
        np.testing.assert_array_equal(out, sum(x), err_msg=f"call {call}")
        shared[...] = x[rt.rank()]
        rt.allreduce(shared, name="express.large.shared", out=shared)
        np.testing.assert_allclose(shared, sum(x) / rt.size(), rtol=1e-6, err_msg=f"call {call}")
        call += 1
    assert not eng.requests
    assert len(ran) == 2 * call, ran               # every call, first sightings included, ran the one-array path
    # most cached calls end in their express cycle; a peer's idle engine thread joining a cycle first sends one to
    # the general path now and then (3 of 6 once, 4 ranks on 2 busy cores), so more calls are made (up to 48)
    # until one did on every rank; a path never taken never does
    assert [kind for _, kind in outcomes].count("agreed") >= 1, outcomes


def test_ranks_with_and_without_their_array_in_the_window_take_one_path(monkeypatch):
    """Past SHARED_EAGER_BYTES an array in the shm window does not travel eagerly but a private one does: when the
    ranks differ, the private ranks see a rank without data in the slots and every rank runs the transport."""
    from ringtrain.engine import cycle_agreement as agreement
    monkeypatch.setattr(agreement, "SHARED_EAGER_BYTES", 8 << 10)
    n = 4099                                       # 16 KB of float32: past the (patched) limit, inside a slot
    x = inputs(n, 8)
    mine = rt.empty_shared(n, np.float32) if rt.rank() == 0 else np.empty(n, np.float32)
    for call in range(4):
        mine[...] = x[rt.rank()]
        rt.allreduce(mine, op=rt.Sum, name="express.mixed", out=mine)
        np.testing.assert_array_equal(mine, sum(x), err_msg=f"call {call}")
    assert not state.engine().requests


def test_a_stopped_timeline_leaves_the_express_path_open(outcomes, tmp_path):
    """While a rank writes a timeline its calls go through the engine's thread (which records their phases); once
    stop_timeline() closed it, synchronous allreduces take the express path again."""
    path = rt.broadcast_object(str(tmp_path / "trace.json"), root_rank=0)
    x = inputs(100, 5)
    want = sum(x)
    rt.start_timeline(path)
    for call in range(5):
        np.testing.assert_array_equal(rt.allreduce(x[rt.rank()], op=rt.Sum, name="express.traced"), want)
    if state.engine().timeline is not None:     # rank 0 writes the trace (the others only with ALL_RANKS)
        assert not [kind for name, kind in outcomes if name == "express.traced"], outcomes
    rt.stop_timeline()
    for call in range(10):
        np.testing.assert_array_equal(rt.allreduce(x[rt.rank()], op=rt.Sum, name="express.traced"), want)
    kinds = [kind for name, kind in outcomes if name == "express.traced"]
    assert {"eager", "agreed"} & set(kinds), kinds


def test_an_idle_rank_leaves_a_peers_cycle_to_its_caller_only_within_the_grace(fallbacks, monkeypatch):
    """Between two synchronous calls a rank's idle engine thread must not follow the peers into the cycle they
    opened: its caller is about to publish that cycle with its own id ready, and a follow-in's empty slot would turn
    every peer's call into an ordinary request (Engine._pass, CALLER_GRACE_S). Past the grace an idle engine thread
    does follow (the stall and straggler machinery sees every cycle). The last rank sleeps before each call, long
    enough for its engine thread's idle looks (driving.IDLE_SLEEP_S) to find the others' cycle open: with the grace
    stretched over the whole test no peer's call leaves the express path; with no grace at all some do."""
    from ringtrain.engine import engine as engine_module
    x = inputs(100, 9)
    late = rt.rank() == rt.size() - 1

    def calls(name, pause):
        for call in range(5):
            if late and pause:
                time.sleep(pause)
            np.testing.assert_array_equal(rt.allreduce(x[rt.rank()], op=rt.Sum, name=name), sum(x),
                                          err_msg=f"{name}, call {call}")

    monkeypatch.setattr(engine_module, "CALLER_GRACE_S", 60.0)
    calls("express.grace", 0.0)              # a first sighting, then express calls in step: the grace starts
    before = len(fallbacks)
    calls("express.grace", 0.06)
    within = len(fallbacks) - before
    monkeypatch.setattr(engine_module, "CALLER_GRACE_S", 0.0)
    before = len(fallbacks)
    calls("express.grace", 0.1)
    past = len(fallbacks) - before
    counts = rt.allgather_object((within, past))
    assert [w for w, _ in counts] == [0] * rt.size(), (
        f"within the grace an idle engine thread followed a peer's cycle: express calls that became requests, "
        f"per rank: {[w for w, _ in counts]}")
    assert sum(p for _, p in counts) >= 1, (
        f"past the grace the last rank's idle engine thread never followed the others' open cycle "
        f"(requests per rank {[p for _, p in counts]})")
    assert not state.engine().requests
