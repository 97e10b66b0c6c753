"""The express cycle in compiled code (ringtrain/engine/native_cycle.py) in a real job: every dtype and op an express
allreduce takes gives bitwise the same result with the native cycle on, off, and on one rank only, equal to the
one-process reference over every rank's input; a rank arriving late hands the wait to Python; a rank that skips a
call still ends in a StallError naming the tensor and the rank, and the job goes on."""
import time

import numpy as np
import pytest
from mpi4py import MPI

import ringtrain as rt
from ringtrain.core import state
from ringtrain.engine import native_cycle
from ringtrain.engine.watchdog import YIELD_S
from ringtrain.ops import DTYPES, ReduceOp, reduce_in_rank_order, result_scale

pytestmark = pytest.mark.mpi(min_size=2)

OPS = {"sum": rt.Sum, "average": rt.Average, "min": rt.Min, "max": rt.Max, "product": rt.Product}


def native_or_skip():
    agreement = state.engine().agreement
    if getattr(agreement, "_native", None) is None:
        pytest.skip(f"no native express cycle in this job (library: {native_cycle.library()!r}, "
                    f"agreement {type(agreement).__name__})")
    return agreement


@pytest.fixture
def native_outcomes(monkeypatch):
    """Every native call's outcome on this rank (the compiled function itself, whichever path called it)."""
    agreement = native_or_skip()
    native = agreement._native
    state.engine().fast.off()                  # the planned C call skips _call: this fixture watches _call alone
    if agreement.fast is not None:
        monkeypatch.setattr(agreement.fast, "on", False)
    seen = []
    original = native._call

    def spy(*args):
        outcome = original(*args)
        seen.append(outcome)
        return outcome
    monkeypatch.setattr(native, "_call", spy)
    return seen


def switch(on):
    """Both ranks between calls: the native cycle on or off on this rank."""
    agreement = state.engine().agreement
    if not hasattr(agreement, "_kept_native"):
        agreement._kept_native = agreement._native
    agreement._native = agreement._kept_native if on else None


@pytest.fixture
def restore_native():
    yield
    switch(True)


def inputs(dtype, n, seed):
    rng = np.random.default_rng(seed * 100 + rt.rank())
    dt = DTYPES[dtype]
    if dt.kind == "f" or dtype == "bfloat16":
        return (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(dt)
    if dt.kind == "b":
        return rng.integers(0, 2, n).astype(dt)
    info = np.iinfo(dt)
    return rng.integers(info.min, info.max, n, dtype=dt, endpoint=True)


def test_native_and_python_cycles_give_the_same_bits(native_outcomes, restore_native):
    comm = MPI.COMM_WORLD
    size, rank = rt.size(), rt.rank()
    done = 0
    for seed, dtype in enumerate(["float32", "float64", "int32", "int64", "float16", "bfloat16", "int8", "uint8",
                                  "int16", "uint16"]):
        for op_name, op in OPS.items():
            for n in (1, 7, 1001):
                x = inputs(dtype, n, seed * 10 + n)
                everyone = comm.allgather(x)
                want = np.empty_like(x)
                reduce_in_rank_order(want, everyone, ReduceOp(op), result_scale(ReduceOp(op), 1.0, size))
                name = f"native.{dtype}.{op_name}.{n}"
                results = {}
                for path in ("first", "native", "python", "mixed", "native again"):
                    switch(path in ("native", "native again") or (path == "mixed" and rank == 0))
                    comm.Barrier()
                    before = len(native_outcomes)
                    out = rt.allreduce(x, op=op, name=name)
                    results[path] = out.tobytes()
                    if path == "native again" and native_cycle.reduce_how(
                            dtype, op, result_scale(ReduceOp(op), 1.0, size), size):
                        # the last rank to arrive finds every slot there: DONE (the others may have stopped spinning)
                        done += comm.allreduce(native_outcomes[before:] == [native_cycle.DONE], op=MPI.MAX)
                for path, got in results.items():
                    assert got == want.tobytes(), f"rank {rank}: {name} {path}: {np.frombuffer(got, x.dtype)} " \
                                                  f"!= {want}"
                theirs = comm.allgather(results["native again"])
                assert all(t == theirs[0] for t in theirs), f"{name}: ranks disagree bitwise"
    # a call the C code reduces finishes natively on the last rank to arrive (unless an engine thread's cycle came
    # between: then Python finished it, correctly, which is what the assertions above checked)
    assert done >= 4 * 2 * 3 // 2, f"only {done} of 24 calls finished in the native cycle on any rank"


def test_a_late_rank_hands_the_wait_to_python(native_outcomes):
    size, rank = rt.size(), rt.rank()
    want = sum(np.arange(100, dtype=np.float32) + r for r in range(size)) / size
    for i in range(6):
        if rank == size - 1 and i % 2:
            time.sleep(0.05)             # far past the native spin's bound
        out = rt.allreduce(np.arange(100, dtype=np.float32) + rank, name="native.late")
        np.testing.assert_array_equal(out, want, err_msg=f"rank {rank} call {i}")
    if rank == 0:
        assert native_cycle.NOT_YET in native_outcomes, native_outcomes


def test_a_rank_a_few_ms_late_is_waited_for_in_native_rounds(native_outcomes, monkeypatch):
    """Past the native spin, within the caller's patience (a core per rank: Watchdog.yield_s): the caller waits in
    further native rounds on the cycle it published (src None), and the late rank's arrival finishes the call there,
    with this call's values (they change every call), not an earlier cycle's."""
    agreement = native_or_skip()
    size, rank = rt.size(), rt.rank()
    spy, resumed = agreement._native._call, []

    def watch(*args):
        outcome = spy(*args)
        if args[5] is None:
            resumed.append(outcome)
        return outcome
    monkeypatch.setattr(agreement._native, "_call", watch)
    counted = agreement._exchange.wait_rows()[rank][size - 1][1]
    for i in range(6):
        x = np.arange(100, dtype=np.float32) + rank + 10 * i
        want = sum(np.arange(100, dtype=np.float32) + r + 10 * i for r in range(size))
        rt.barrier()
        if rank == size - 1 and i % 2:
            time.sleep(0.003)
        out = rt.allreduce(x, op=rt.Sum, name="native.few_ms_late")
        np.testing.assert_array_equal(out, want, err_msg=f"rank {rank} call {i}")
    patient = state.engine().watchdog.yield_s() > YIELD_S
    if rank == 0 and patient:           # (more ranks than cores: the caller sleeps in the Watchdog instead)
        assert native_cycle.DONE in resumed, (resumed, native_outcomes)
        if agreement.stragglers is not None:    # such a wait counts for the stragglers as a gather's does
            assert agreement._exchange.wait_rows()[rank][size - 1][1] > counted, agreement._exchange.wait_rows()


def test_a_skipped_call_still_stalls_naming_the_rank_and_tensor():
    """With a short stall timeout: the last rank skips a cached allreduce the others make in the native cycle."""
    rt.shutdown()
    rt.init(stall_timeout_s=1.0, stall_warning_s=0.5)
    try:
        agreement = native_or_skip()
        outcomes = []
        original = agreement._native._call
        agreement._native._call = lambda *a: outcomes.append(original(*a)) or outcomes[-1]
        size, rank = rt.size(), rt.rank()
        odd = rank == size - 1
        ones = np.ones(8, np.float32)
        for _ in range(2):
            np.testing.assert_array_equal(rt.allreduce(ones, op=rt.Sum, name="native.stall"), ones * size)
        outcomes.clear()
        rt.barrier()
        if odd:
            time.sleep(0.5)             # the skipped call is the older stalled name (see stall_then_continue.py)
        else:
            with pytest.raises(rt.StallError) as caught:
                rt.allreduce(ones, op=rt.Sum, name="native.stall")
            message = str(caught.value)
            assert "native.stall" in message and f"{size - 1}" in message, message
            assert outcomes and outcomes[0] in (native_cycle.NOT_YET, native_cycle.ARRIVED), outcomes
        for i in range(4):
            got = rt.allreduce(np.full(8, rank + 1.0, np.float32), op=rt.Sum, name=f"native.after{i % 2}")
            np.testing.assert_array_equal(got, np.full(8, size * (size + 1) / 2), err_msg=f"rank {rank} after {i}")
    finally:
        rt.shutdown()
        rt.init()


def test_a_strided_out_takes_the_python_cycle(native_outcomes):
    """A strided output cannot go through the native call (it writes contiguous bytes): such calls take the Python
    cycle, give the right result and leave the elements between the view's untouched."""
    size, rank = rt.size(), rt.rank()
    x = np.arange(32, dtype=np.float32) + rank
    want = sum(np.arange(32, dtype=np.float32) + r for r in range(size))
    for i in range(3):
        y = np.full(64, -1.0, np.float32)
        rt.allreduce(x, op=rt.Sum, name="native.strided", out=y[::2])
        np.testing.assert_array_equal(y[::2], want, err_msg=f"rank {rank} call {i}")
        assert (y[1::2] == -1).all(), f"rank {rank} call {i}: {y}"
    assert native_outcomes == [], native_outcomes


def test_an_async_call_waited_at_once_rides_the_native_cycle(native_outcomes):
    """A small async allreduce submitted while the engine is idle is held back and run on the waiting thread: that
    run is the express cycle, native too."""
    size, rank = rt.size(), rt.rank()
    x = np.arange(256, dtype=np.float32) + rank
    want = sum(np.arange(256, dtype=np.float32) + r for r in range(size)) / size
    for i in range(10):
        got = rt.allreduce_async(x, name="native.async").wait()
        np.testing.assert_array_equal(got, want, err_msg=f"rank {rank} call {i}")
    anywhere = MPI.COMM_WORLD.allreduce(native_outcomes.count(native_cycle.DONE), op=MPI.SUM)
    assert anywhere >= 1, f"no held-back async call finished in the native cycle on any rank: {native_outcomes}"


def test_grouped_calls_of_one_shape_with_other_ops_and_scales():
    """Small grouped allreduces (packed into the cycle's slots) of the same sizes under different ops and scales:
    each gets its own metadata (they are cached per group)."""
    size, rank = rt.size(), rt.rank()
    parts = [np.arange(5, dtype=np.float64) + rank, np.arange(300, dtype=np.float64) * 2 + rank]
    total = [sum(np.arange(5, dtype=np.float64) + r for r in range(size)),
             sum(np.arange(300, dtype=np.float64) * 2 + r for r in range(size))]
    for i in range(3):
        for name, op, post, want in [("sum", rt.Sum, 1.0, total), ("avg", rt.Average, 1.0, [t / size for t in total]),
                                     ("avg.post", rt.Average, 3.0, [t * 3.0 / size for t in total]),
                                     ("max", rt.Max, 1.0, [p - rank + size - 1 for p in parts])]:
            got = rt.grouped_allreduce(parts, op=op, postscale_factor=post, name=f"native.grouped.{name}")
            for g, w in zip(got, want):
                np.testing.assert_allclose(g, w, rtol=1e-12, err_msg=f"rank {rank} {name} call {i}")


def test_small_groups_native_python_and_mixed_give_the_same_bits(restore_native):
    """A recurring small group is packed into one fresh array (its members read where they lie) and reduced in place
    as one small allreduce, its results views of that array: every dtype (those the C code reduces and those Python
    reduces from the slots), Sum and Average, with an empty and a 2-D member, gives bitwise each member's
    one-process reference with the native cycle on, off and on one rank only; results of earlier calls keep their
    values."""
    agreement = native_or_skip()
    comm = MPI.COMM_WORLD
    size, rank = rt.size(), rt.rank()
    grouped_outcomes = []
    native = agreement._native
    original = native._call

    def spy(*args):
        grouped_outcomes.append(original(*args))
        return grouped_outcomes[-1]
    native._call = spy
    shapes = [(3,), (0,), (2, 5), (1,), (40,)]
    held = []
    try:
        for seed, dtype in enumerate(["float32", "float64", "int32", "int64", "float16", "bfloat16", "int8", "uint8",
                                      "int16", "uint16"]):
            for op_name in ("sum", "average"):
                op = OPS[op_name]
                members = [inputs(dtype, int(np.prod(s)), 50 + seed * 10 + k).reshape(s) for k, s in enumerate(shapes)]
                everyone = comm.allgather(members)
                want = []
                for k, member in enumerate(members):
                    w = np.empty_like(member)
                    reduce_in_rank_order(w.reshape(-1), [theirs[k].reshape(-1) for theirs in everyone], ReduceOp(op),
                                         result_scale(ReduceOp(op), 1.0, size))
                    want.append(w)
                name = f"native.group.{dtype}.{op_name}"
                for path in ("first", "native", "python", "mixed", "native again"):
                    switch(path in ("native", "native again") or (path == "mixed" and rank == 0))
                    comm.Barrier()
                    got = rt.grouped_allreduce(members, op=op, name=name)
                    for k, (g, w) in enumerate(zip(got, want)):
                        assert g.shape == w.shape and g.dtype == w.dtype, (name, path, k, g.shape, g.dtype)
                        assert g.tobytes() == w.tobytes(), f"rank {rank}: {name} {path} member {k}: {g} != {w}"
                    held.append((got, want))
    finally:
        native._call = original
    for got, want in held:
        assert all(g.tobytes() == w.tobytes() for g, w in zip(got, want)), f"rank {rank}: a result held changed"
    many = [np.full(1, rank + k, np.int64) for k in range(1500)]      # a group of many members: no limit
    for _ in range(3):
        got = rt.grouped_allreduce(many, op=rt.Sum, name="native.group.many")
        assert [int(g[0]) for g in got] == [size * k + size * (size - 1) // 2 for k in range(1500)]
    # the native cycle ran the packed groups, and finished some calls itself on some rank
    assert grouped_outcomes, "no small group went through the native cycle"
    assert comm.allreduce(grouped_outcomes.count(native_cycle.DONE), op=MPI.SUM) >= 1, grouped_outcomes


def fast_or_skip():
    agreement = native_or_skip()
    if agreement.fast is None:
        pytest.skip("no compiled planned call in this job (perf_counter is not CLOCK_MONOTONIC here)")
    return agreement


@pytest.fixture
def python_calls(monkeypatch):
    """One entry per call that entered the agreement's Python express (the compiled planned call does not)."""
    agreement = fast_or_skip()
    calls = []
    original = agreement.express

    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)
    monkeypatch.setattr(agreement, "express", spy)
    return calls


def collected(engine, kind="allreduce"):
    """The metrics endpoint's count of `kind` for this engine, as a scrape reads it."""
    from ringtrain.core import metrics
    for family in metrics._Collector(lambda: [(0, engine)], rt.rank()).collect():
        if family.name == "ringtrain_collectives":
            return sum(s.value for s in family.samples if s.labels["kind"] == kind)
    return 0


def more_rounds(calls, least, in_c, want, most=4):
    """Whether a share test makes another round of calls (every rank decides alike): until `least` calls are made,
    and past them while no rank has `want` calls in the compiled call, up to `most` times `least`. A loaded machine
    with more ranks than cores sends many calls to Python (a peer descheduled past the compiled call's spin, an
    engine thread following a cycle) but reaches `want` within a few rounds; a path never (or almost never) taken
    never does."""
    if calls < least:
        return True
    return calls < most * least and MPI.COMM_WORLD.allreduce(in_c, op=MPI.MAX) < want


def test_the_planned_c_call_keeps_results_stats_recorder_and_cycles(python_calls):
    """The planned call done whole in C (plan.fast, armed after an express call): numpy-equal results, most calls
    never enter Python's express, a late rank's call (NOT_YET) finished by Python; then the stats, the metrics
    endpoint and the flight recorder (its dump too) show every call, in call order, and every rank is at the same
    cycle."""
    agreement = fast_or_skip()
    engine = state.engine()
    comm = MPI.COMM_WORLD
    size, rank = rt.size(), rt.rank()
    engine.fast.drain()
    before = engine.stats.local().get("allreduce", {}).get("count", 0)
    scraped = collected(engine)
    seq = engine.recorder.seq
    rng = np.random.default_rng(rank)
    calls = 0
    start = time.perf_counter()
    while more_rounds(calls, 600, 2 * calls - len(python_calls), 300):
        for i in range(calls, calls + 200):
            x = rng.standard_normal(1024).astype(np.float32)
            if rank == size - 1 and i % 200 == 7:
                time.sleep(0.002)              # the others' C calls end NOT_YET: the resumed Python path
            got = rt.allreduce(x, name="cctx.a")
            z = np.full(8, i, np.int64)
            assert rt.allreduce(z, op=rt.Sum, name="cctx.b", out=z) is z
            want = np.zeros(1024, np.float32)
            reduce_in_rank_order(want, comm.allgather(x), ReduceOp.AVERAGE,
                                 result_scale(ReduceOp.AVERAGE, 1.0, size))
            assert got.tobytes() == want.tobytes(), f"rank {rank} call {i}"
            assert (z == i * size).all(), f"rank {rank} call {i}: {z}"
        calls += 200
    end = time.perf_counter()
    assert collected(engine) - scraped == 2 * calls, f"rank {rank}: the metrics miss calls"   # (it drains first)
    counted = engine.stats.local()["allreduce"]["count"] - before
    assert counted == 2 * calls, f"rank {rank}: stats counted {counted} of {2 * calls}"
    assert engine.recorder.seq - seq == 2 * calls, f"rank {rank}: {engine.recorder.seq - seq} entries recorded"
    names = [e["name"] for e in engine.recorder.entries()[-40:]]
    assert names == ["cctx.a", "cctx.b"] * 20, names
    assert start <= engine.express_end <= end        # the C calls' clock is perf_counter's
    path = rt.dump_flight_recorder(reason="test")
    if path is not None:
        import json
        with open(path) as f:
            dumped = json.load(f)
        assert [e["name"] for e in dumped["collectives"][-4:]] == ["cctx.a", "cctx.b"] * 2, dumped["collectives"][-4:]
    assert len(set(comm.allgather(agreement._cycle))) == 1
    in_c = 2 * calls - len(python_calls)
    assert comm.allreduce(in_c, op=MPI.MAX) >= 300, f"rank {rank}: only {in_c} of {2 * calls} calls in C"


def test_an_unresolved_cycle_holds_other_callers_until_its_caller_finishes_it(monkeypatch):
    """Rank 0's C call publishes a cycle its peers are late for (NOT_YET) and returns; before its caller finishes
    it, another thread calls: that thread's express does nothing (None) and its call goes the general way, waiting
    (no pass runs over the unresolved cycle); then the caller finishes its cycle and both results are right."""
    import threading
    agreement = fast_or_skip()
    engine = state.engine()
    comm = MPI.COMM_WORLD
    size, rank = rt.size(), rt.rank()
    x = np.full(64, rank + 1.0, np.float32)
    y = np.full(16, rank + 1.0, np.float64)
    for _ in range(2):
        rt.allreduce(x, op=rt.Sum, name="gap.b")
        rt.allreduce(y, op=rt.Sum, name="gap.a")
    comm.Barrier()
    if rank != 0:
        time.sleep(0.5)
        got_b = rt.allreduce(x, op=rt.Sum, name="gap.b")
        got_a = rt.allreduce(y, op=rt.Sum, name="gap.a")
    else:
        plan = engine.memo.get(("gap.b", rt.Sum, x.dtype, x.shape, 1.0, 1.0))
        with engine._progress_lock:
            engine.fast.take()
            assert engine.fast.arm()
        got_b = np.empty_like(x)
        outcome = plan.fast[0](plan.fast, x, got_b)
        assert outcome == native_cycle.NOT_YET, outcome          # the peers sleep
        seen = []
        original = engine.express

        def spy(name, *args):
            seen.append((name, original(name, *args)))
            return seen[-1][1]
        monkeypatch.setattr(engine, "express", spy)
        result = {}
        other = threading.Thread(target=lambda: result.setdefault("a", rt.allreduce(y, op=rt.Sum, name="gap.a")))
        other.start()
        time.sleep(0.2)
        assert other.is_alive() and seen == [("gap.a", None)], seen
        done = engine.express("gap.b", plan.meta, x, got_b, None, plan, outcome)
        if done is not True:        # (a peer's engine thread may have followed into that cycle with nothing ready)
            done.wait()
        other.join(60)
        assert not other.is_alive()
        got_a = result["a"]
    total = size * (size + 1) / 2
    np.testing.assert_array_equal(got_b, np.full(64, total, np.float32), err_msg=f"rank {rank}")
    np.testing.assert_array_equal(got_a, np.full(16, total), err_msg=f"rank {rank}")
    engine.fast.drain()
    assert len(set(comm.allgather(agreement._cycle))) == 1


def test_rank_0_keeps_the_use_order_under_churn():
    """A cache of 8 ids and 12 names used in a random (shared) order, most calls in C: rank 0's LRU order is the
    order of the names' last uses (what per-call touches leave), so its evictions are those of the Python path;
    every result is right and every rank recorded every call under its name."""
    rt.shutdown()
    rt.init(cache_capacity=8)
    try:
        agreement = fast_or_skip()
        engine = state.engine()
        size, rank = rt.size(), rt.rank()
        rng = np.random.default_rng(7)                        # the same draws on every rank
        used = []
        seq = engine.recorder.seq
        for step in range(400):
            k = int(rng.integers(0, 12)) if step % 4 == 0 else int(rng.integers(0, 5))   # 5 hot names, 7 cold
            got = rt.allreduce(np.full(32, rank + k, np.float32), op=rt.Sum, name=f"lru.{k}")
            np.testing.assert_array_equal(got, np.full(32, size * k + size * (size - 1) / 2), err_msg=f"{step}")
            used.append(f"lru.{k}")
        engine.fast.drain()
        assert engine.recorder.seq - seq == len(used)
        assert [e["name"] for e in engine.recorder.entries()[-len(used):]] == used[-engine.recorder.capacity:]
        if rank == 0:
            cache = agreement.coordinator.cache
            lru = [cache.keys[cid][0] for cid in cache._recent]
            by_last_use = [name for name in reversed(list(dict.fromkeys(reversed(used))))]
            assert lru == [name for name in by_last_use if name in lru], (lru, by_last_use)
    finally:
        rt.shutdown()
        rt.init()


def test_async_calls_waited_at_once_ride_the_compiled_call(python_calls):
    """A held-back async allreduce submitted while the C ctx is armed keeps it armed for its own wait, which is then
    one C call: most prompt waits never enter Python's express; results are numpy-equal, also with sync calls in
    between, two async calls in flight waited out of order, and ranks submitting them in different orders."""
    agreement = fast_or_skip()
    engine = state.engine()
    comm = MPI.COMM_WORLD
    size, rank = rt.size(), rt.rank()
    rng = np.random.default_rng(10 + rank)
    calls = 0
    while more_rounds(calls, 300, 2 * calls - len(python_calls), 150):
        for i in range(calls, calls + 100):
            x = rng.standard_normal(512).astype(np.float32)
            want = np.zeros(512, np.float32)
            reduce_in_rank_order(want, comm.allgather(x), ReduceOp.AVERAGE,
                                 result_scale(ReduceOp.AVERAGE, 1.0, size))
            got = rt.allreduce_async(x, name="held.a").wait()
            assert got.tobytes() == want.tobytes(), f"rank {rank} call {i}"
            z = np.full(4, i, np.int64)
            rt.allreduce_async(z, op=rt.Sum, name="held.b", out=z).wait()
            assert (z == i * size).all(), f"rank {rank} call {i}: {z}"
            if i % 50 == 0:                # two in flight, waited out of order, submitted in rank-dependent order
                order = ("held.c", "held.d") if rank % 2 else ("held.d", "held.c")
                offset = {"held.c": 0.0, "held.d": 100.0}
                hs = {n: rt.allreduce_async(np.full(8, rank + offset[n]), op=rt.Sum, name=n) for n in order}
                for n in reversed(order):
                    want_n = size * (size - 1) / 2 + size * offset[n]
                    assert (hs[n].wait() == want_n).all(), f"rank {rank} call {i} {n}"
        calls += 100
    in_c = 2 * calls - len(python_calls)
    print(f"ASYNC rank {rank}: {in_c} of {2 * calls} async waits in C")
    assert comm.allreduce(in_c, op=MPI.MAX) >= 150, f"rank {rank}: only {in_c} of {2 * calls} async waits in C"
    engine.fast.drain()
    assert len(set(comm.allgather(agreement._cycle))) == 1


def test_a_long_drain_leaves_a_peers_cycle_to_the_caller(monkeypatch):
    """An engine-thread pass first drains the compiled calls (fast.take), which for a thousand calls takes longer
    than the caller's grace (Engine._pass, CALLER_GRACE_S) while the caller, between two of its calls, waits for the
    GIL: the grace counts from the pass's start, so a pass right after a call still leaves a peer's open cycle to
    the caller (a follow-in's empty slot would turn the peer's call into an ordinary request). Here the pass runs on
    this thread right after a compiled call, its drain made to last three times the grace (stretched to 20 ms)."""
    from ringtrain.engine import engine as engine_module
    engine = state.engine()
    agreement = native_or_skip()
    if agreement.fast is None:
        pytest.skip("no compiled planned call in this job")
    grace = 0.02                    # (stretched past most scheduling gaps between a call and the pass after it)
    monkeypatch.setattr(engine_module, "CALLER_GRACE_S", grace)
    real_take, real_poll = engine.fast.take, agreement.poll
    looks = []

    def take(in_pass=False):
        got = real_take(in_pass)
        until = time.perf_counter() + 3 * grace
        while time.perf_counter() < until:      # (a drain is Python: it holds the GIL all along)
            pass
        return got

    def poll(lazy=False):
        looks.append(lazy)
        return real_poll(lazy)
    x = np.arange(64, dtype=np.float32) + rt.rank()
    want = sum(np.arange(64, dtype=np.float32) + r for r in range(rt.size()))
    for call in range(4):
        rt.barrier()
        for _ in range(3):          # (the first calls make the plan and arm the compiled call)
            np.testing.assert_array_equal(rt.allreduce(x, op=rt.Sum, name="native.long_drain"), want)
        with engine._progress_lock:
            monkeypatch.setattr(engine.fast, "take", take)
            monkeypatch.setattr(agreement, "poll", poll)
            engine._guarded_pass(background=True)
            monkeypatch.undo()
            monkeypatch.setattr(engine_module, "CALLER_GRACE_S", grace)
    rt.barrier()
    assert sum(looks) >= len(looks) // 2 > 0, (     # (a rank descheduled past the grace may follow now and then)
        f"rank {rt.rank()}: a pass right after a call, whose drain outlasted the grace, would follow a peer into an "
        f"open cycle (lazy looks: {looks})")
