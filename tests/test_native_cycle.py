"""The compiled express cycle (ringtrain/engine/native_cycle.py) against the Python path, in one process: the ranks'
published words and slots are plain numpy buffers laid out as the shared window lays them out, rank 0 makes the
native call and the peers' slots are written by the Python path's own _fill (cycle_exchange.py)."""
import os
import time

import numpy as np
import pytest

from ringtrain.config import Config
from ringtrain.engine import native_cycle
from ringtrain.engine.cycle_exchange import _Exchange
from ringtrain.ops import DTYPES, ReduceOp, reduce_in_rank_order, result_scale

WORDS = 2
EAGER = 64 << 10

if isinstance(native_cycle.library(), str):
    # CI (every extra required) must run the native code: there a missing C compiler fails instead of skipping
    assert os.environ.get("RINGTRAIN_REQUIRE_EXTRAS") != "1", native_cycle.library()
    pytest.skip(f"the native express cycle cannot be built here: {native_cycle.library()}", allow_module_level=True)


def copy_in(slot, array):
    slot[:] = array.reshape(-1)


class World:
    """Every rank's published word and two slots in one process; exchanges[p] is rank p's Python view of them."""

    def __init__(self, size, me=0):
        self.size, self.me = size, me
        self.exchanges = [_Exchange(p, size, Config(), None, WORDS, EAGER, copy_in) for p in range(size)]
        slot_bytes = self.exchanges[0].slot_bytes
        self.published = [np.zeros(8, np.int64) for _ in range(size)]     # a cache line each
        self.buffers = [(np.zeros(slot_bytes, np.uint8), np.zeros(slot_bytes, np.uint8)) for _ in range(size)]
        for exchange in self.exchanges:
            exchange._slots = exchange._views(self.buffers)
        ex = self.exchanges[me]
        self.native = native_cycle.NativeCycle.open(
            me, size, ex._header_bytes, (4 + 2 * size) * 8, [a.ctypes.data for a in self.published],
            [tuple(b.ctypes.data for b in pair) for pair in self.buffers])
        assert self.native is not None

    def peer_publishes(self, p, c, flags, bitmap, eager):
        self.exchanges[p]._fill(c, flags, bitmap, WORDS, eager)
        self.published[p][0] = c

    def express(self, c, cid, array, out, how, flags=0, spin_s=native_cycle.SPIN_S):
        return self.native.express(c, flags, cid, WORDS, array, out, how, spin_s)

    def close(self):
        self.native.close()


def how_for(dtype, op, size, postscale=1.0):
    return native_cycle.reduce_how(dtype, op, result_scale(op, postscale, size), size)


def inputs(dtype, n, size, seed):
    rng = np.random.default_rng(seed)
    if np.dtype(DTYPES[dtype]).kind == "f":
        # values over many magnitudes: a sum in any other order than rank order gives other bits
        return [(rng.standard_normal(n) * 10.0 ** rng.integers(-6, 7, n)).astype(DTYPES[dtype]) for _ in range(size)]
    info = np.iinfo(DTYPES[dtype])
    return [rng.integers(info.min, info.max, n, dtype=DTYPES[dtype], endpoint=True) for _ in range(size)]


@pytest.mark.parametrize("size", [2, 3, 4])
def test_the_native_reduce_is_bitwise_the_python_reduce(size):
    """Every dtype and op the native reduce takes, Average with and without a postscale, odd sizes, the call made by
    each rank in turn: the same bits as ops.reduce_in_rank_order over the ranks' copies (what the Python path's
    executor computes on every rank)."""
    worlds = [World(size, me) for me in range(size)]      # the native call made by each rank in turn
    c, cid = 0, 70                         # an id in the second bitmap word
    cases = 0
    try:
        for dtype in ("float32", "float64", "int32", "int64"):
            for op in (ReduceOp.SUM, ReduceOp.AVERAGE):
                for postscale in (1.0, 0.5):
                    for n in (1, 7, 1001):
                        how = how_for(dtype, op, size, postscale)
                        c += 1
                        arrays = inputs(dtype, n, size, seed=c)
                        world = worlds[c % size]
                        for p in range(size):
                            if p != world.me:
                                world.peer_publishes(p, c, 0, 1 << cid, (cid, arrays[p]))
                        out = np.full(n, 99, DTYPES[dtype])
                        assert world.express(c, cid, arrays[world.me], out, how) == native_cycle.DONE
                        want = np.empty(n, DTYPES[dtype])
                        reduce_in_rank_order(want, arrays, op, result_scale(op, postscale, size))
                        assert out.tobytes() == want.tobytes(), (world.me, dtype, op, postscale, n)
                        cases += 1
    finally:
        for world in worlds:
            world.close()
    assert cases == 4 * 2 * 2 * 3


def test_in_place_and_the_slot_rank_0_writes_are_the_python_path():
    """out may be the input (in place); rank 0's slot holds what _fill writes: the same header, bitmap and data."""
    world = World(2)
    try:
        a = np.arange(10, dtype=np.float32)
        b = np.arange(10, dtype=np.float32) * 3
        world.peer_publishes(1, 1, 0, 1 << 5, (5, b))
        assert world.express(1, 5, a, a, how_for("float32", ReduceOp.AVERAGE, 2)) == native_cycle.DONE
        np.testing.assert_array_equal(a, (np.arange(10) + np.arange(10) * 3) / 2)
        assert world.published[0][0] == 1
        native_slot = world.buffers[0][1].copy()
        world.exchanges[0]._fill(1, 0, 1 << 5, WORDS, (5, np.arange(10, dtype=np.float32)))
        used = world.exchanges[0]._header_bytes + 40
        assert native_slot[:used].tobytes() == world.buffers[0][1][:used].tobytes()
    finally:
        world.close()


def test_any_other_snapshot_is_left_to_python():
    """A peer's flag, a peer without the id ready, other eager data (id or size), a dtype/op the C code does not
    reduce: ARRIVED, out untouched; a peer that has not published: NOT_YET after the bounded spin."""
    world = World(3)
    how = how_for("float32", ReduceOp.SUM, 3)
    a = np.ones(16, np.float32)
    c = 0
    try:
        for flags, bitmaps, eagers, h in [
                ((1, 0), (1 << 3, 1 << 3), (3, 3), how),             # rank 1 wants the coordinator
                ((0, 2), (1 << 3, 1 << 3), (3, 3), how),             # rank 2: its coordinator is busy
                ((0, 0), (1 << 3, 1 << 4), (3, 3), how),             # rank 2 does not have id 3 ready
                ((0, 0), (1 << 3, 1 << 3), (3, None), how),          # rank 2 published no eager data
                ((0, 0), (1 << 3, 1 << 3), (3, 4), how),             # rank 2 published another id's data
                ((0, 0), (1 << 3, 1 << 3), (3, 3), None)]:           # a reduce the C code leaves to Python
            c += 1
            for p in (1, 2):
                eager = None if eagers[p - 1] is None else (eagers[p - 1], a)
                world.peer_publishes(p, c, flags[p - 1], bitmaps[p - 1], eager)
            out = np.zeros(16, np.float32)
            assert world.express(c, 3, a, out, h) == native_cycle.ARRIVED, (flags, bitmaps, eagers)
            assert not out.any()
        c += 1
        world.peer_publishes(1, c, 0, 1 << 3, (3, a[:8]))               # same id, other size
        world.peer_publishes(2, c, 0, 1 << 3, (3, a))
        assert world.express(c, 3, a, np.zeros(16, np.float32), how) == native_cycle.ARRIVED
        c += 1
        world.peer_publishes(1, c, 0, 1 << 3, (3, a))                   # rank 2 is late
        start = time.perf_counter()
        assert world.express(c, 3, a, np.zeros(16, np.float32), how, spin_s=1e-3) == native_cycle.NOT_YET
        assert 1e-3 <= time.perf_counter() - start < 0.5
        assert world.published[0][0] == c                               # published all the same
        assert world.express(c, 3, a, np.zeros(16, np.float32), how, flags=1) == native_cycle.NOT_YET
    finally:
        world.close()


def test_own_flag_is_never_reduced_natively():
    world = World(2)
    try:
        a = np.ones(4, np.float64)
        world.peer_publishes(1, 1, 0, 1 << 0, (0, a))
        out = np.zeros(4)
        assert world.express(1, 0, a, out, how_for("float64", ReduceOp.SUM, 2), flags=2) == native_cycle.ARRIVED
        assert not out.any()
    finally:
        world.close()


def test_reduce_how_takes_only_what_the_c_code_reduces_bitwise():
    assert native_cycle.reduce_how("float32", ReduceOp.AVERAGE, 0.25, 4) == (1, 0.25, 1)
    assert native_cycle.reduce_how("float64", ReduceOp.SUM, 1.0, 4) == (2, 1.0, 1)
    assert native_cycle.reduce_how("int64", ReduceOp.AVERAGE, 1 / 3, 3) == (7, 1 / 3, 3)
    assert native_cycle.reduce_how("int32", ReduceOp.SUM, 0.5, 2) == (5, 0.5, 2)    # a postscale 1/k: divide by k
    assert native_cycle.reduce_how("int32", ReduceOp.SUM, 0.4, 2) is None          # any other: Python's rounding
    assert native_cycle.reduce_how("int32", ReduceOp.SUM, -0.5, 2) is None
    for dtype in ("float16", "bfloat16", "int8", "uint8", "int16", "uint16", "bool"):
        assert native_cycle.reduce_how(dtype, ReduceOp.SUM, 1.0, 2) is None
    for op in (ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT):
        assert native_cycle.reduce_how("float32", op, 1.0, 2) is None


def test_the_compiled_call_keeps_its_state_until_drained():
    """fast(): nothing unless armed and the record's generation is the ctx's; while armed, each call is one cycle
    (the peer's slot read, the result reduced) with its count, bytes and ring entry kept in the ctx; a late peer
    leaves the cycle unresolved and disarms; a full ring declines until drained; the drain returns every call in
    call order, stamped with perf_counter's clock."""
    world = World(2)
    module = native_cycle.library()
    ctx = world.native._ctx
    how = how_for("float32", ReduceOp.SUM, 2)
    rec = (module.fast, ctx, 7, 3, how[0], how[1], how[2])
    stale = (module.fast, ctx, 6, 3, how[0], how[1], how[2])
    a = np.arange(16, dtype=np.float32)
    try:
        out = np.zeros_like(a)
        assert module.fast(rec, a, out) is None                         # not armed
        assert module.fast_disarm(ctx) is None                          # nothing to drain
        assert module.fast_arm(ctx, 10, 7, WORDS, 50_000, 0) is True
        assert module.fast(stale, a, out) is None                       # a plan read at another cache generation
        before = time.perf_counter()
        for c in (11, 12, 13):
            world.peer_publishes(1, c, 0, 1 << 3, (3, a * c))
            assert module.fast(rec, a, out) is True, c
            np.testing.assert_array_equal(out, a + a * c)
        assert module.fast(rec, a, out) == native_cycle.NOT_YET        # the peer has not published 14
        assert world.published[0][0] == 14
        assert module.fast(rec, a, out) is None                         # disarmed by the unresolved cycle
        assert module.fast_arm(ctx, 13, 7, WORDS, 50_000, 0) is False   # and not armed again until it is resolved
        after = time.perf_counter()
        cycle, unresolved, ucid, last_end, count, nbytes, ns, cids, starts, ends = module.fast_disarm(ctx)
        assert (cycle, unresolved, ucid, count, nbytes, cids) == (13, 14, 3, 3, 3 * a.nbytes, [3, 3, 3])
        assert before * 1e9 <= starts[0] <= ends[0] <= starts[1] <= ends[2] == last_end <= after * 1e9
        assert ns == sum(e - s for s, e in zip(starts, ends))
        module.fast_resolved(ctx)
        assert module.fast_disarm(ctx) is None
        # a full ring: the call declines (its caller goes the Python way, which drains), nothing is lost
        assert module.fast_arm(ctx, 100, 7, WORDS, 50_000, 1) is True   # stub: no window, DONE at once
        taken = sum(module.fast(rec, a, a) is True for _ in range(5000))
        assert taken == 4096
        got = module.fast_disarm(ctx)
        assert got[0] == 100 + 4096 and got[4] == 4096 and len(got[7]) == 4096
        assert module.fast_arm(ctx, got[0], 7, WORDS, 50_000, 1) is True
        assert module.fast(rec, a, a) is True
        module.fast_disarm(ctx, 0)                                      # disarm only: the count waits for a drain
        assert module.fast(rec, a, a) is None
        assert module.fast_disarm(ctx)[4] == 1
        assert abs(module.clock_ns() - time.perf_counter_ns()) < 1e8       # one clock
    finally:
        world.close()


def test_a_held_async_call_keeps_the_armed_ctx_for_its_own_wait():
    """fast_hold: an armed ctx stays armed for the held-back call's wait alone (plain calls decline meanwhile); once
    that wait's call is done, any planned call runs again; an unarmed ctx holds nothing."""
    world = World(2)
    module = native_cycle.library()
    ctx = world.native._ctx
    how = how_for("float32", ReduceOp.SUM, 2)
    rec = (module.fast, ctx, 1, 3, how[0], how[1], how[2])
    a = np.arange(8, dtype=np.float32)
    try:
        assert module.fast_hold(ctx) is False                      # not armed: nothing to keep
        assert module.fast_arm(ctx, 0, 1, WORDS, 50_000, 0) is True
        assert module.fast(rec, a, np.empty_like(a), "held") is None   # a held call's wait needs fast_hold first
        assert module.fast_hold(ctx) is True
        assert module.fast_hold(ctx) is False                      # one held call at a time
        assert module.fast(rec, a, np.empty_like(a)) is None       # a plain call would overtake the held one
        world.peer_publishes(1, 1, 0, 1 << 3, (3, a))
        out = np.empty_like(a)
        assert module.fast(rec, a, out, "held") is True
        np.testing.assert_array_equal(out, 2 * a)
        world.peer_publishes(1, 2, 0, 1 << 3, (3, a))
        assert module.fast(rec, a, out) is True                    # armed for any call again
        assert module.fast_hold(ctx) is True
        module.fast_disarm(ctx, 0)                                 # a submission, a pass: the hold ends too
        assert module.fast(rec, a, out, "held") is None
        assert module.fast_disarm(ctx)[4] == 2
    finally:
        world.close()


def test_read_group_is_the_bindings_python_read():
    """The compiled read_group (express_group.c) returns what the torch binding's Python read returns: one (dtype,
    shape, is_cpu) per tensor and their addresses, or None for the addresses when one tensor is not contiguous; the
    same exception type for what is not a tensor."""
    torch = pytest.importorskip("torch")
    from ringtrain.torch import group_reads
    compiled = native_cycle.library().read_group
    base = torch.arange(60, dtype=torch.float32)
    groups = {
        "slices": [base[:10], base[10:40]],
        "2-D and empty": [base[:6].view(2, 3), base[6:6], base[6:60]],
        "dtypes": [torch.zeros(3, dtype=torch.float64), torch.zeros(2, dtype=torch.int32), base[:1]],
        "bfloat16": [torch.zeros(4, dtype=torch.bfloat16), torch.zeros((), dtype=torch.bfloat16)],
        "strided first": [base[::2], base[:5]],
        "strided last": [base[:5], base[10:40].view(6, 5).t()],
        "one": [base],
        "none": [],
    }
    for what, tensors in groups.items():
        for given in (tensors, tuple(tensors)):
            got = compiled(given)
            assert got == group_reads.read_python(given), what
            signature, members = got
            assert signature == tuple((t.dtype, t.shape, t.is_cpu) for t in tensors), what
            contiguous = all(t.is_contiguous() for t in tensors)
            assert members == (tuple(t.data_ptr() for t in tensors) if contiguous else None), what
    assert compiled([base[3:5]])[1] == (base.data_ptr() + 12,)
    for bad in ([base, "x"], [1, base], [None]):
        with pytest.raises(AttributeError):
            group_reads.read_python(bad)
        with pytest.raises(AttributeError):
            compiled(bad)
    with pytest.raises(TypeError):
        compiled(iter([base]))        # the binding hands over a list: anything else is a TypeError

    class Failing:
        """A tensor-like whose is_contiguous() or data_ptr() raises: the read raises it too."""
        dtype, shape, is_cpu = torch.float32, torch.Size([2]), True

        def __init__(self, failing):
            self.failing = failing

        def is_contiguous(self):
            if self.failing == "is_contiguous":
                raise RuntimeError("is_contiguous failed")
            return True

        def data_ptr(self):
            if self.failing == "data_ptr":
                raise RuntimeError("data_ptr failed")
            return 64

    for failing in ("is_contiguous", "data_ptr"):      # (the Python read takes torch's own getters: tensors only)
        with pytest.raises(RuntimeError, match=f"{failing} failed"):
            compiled([base, Failing(failing)])
    assert compiled([Failing(None), base]) == (((torch.float32, torch.Size([2]), True), (base.dtype, base.shape, True)),
                                               (64, base.data_ptr()))
    group_reads.read([base])                  # (its first call picks the reader)
    assert group_reads.read is compiled, "the torch binding reads its groups in Python although the module is built"


def test_the_drains_bookkeeping_is_the_python_bookkeeping():
    """fast_record and fast_durations (express_fast.c: a drain's per-call work) write the flight recorder's ring and
    the stats' samples exactly as the Python loops do: the same entries, numbers and float bits, a drain larger than
    the ring and an entry recorded after the calls included; a missing key is a KeyError."""
    from ringtrain.engine.flight_recorder import FlightRecorder
    from ringtrain.engine.model import Meta
    module = native_cycle.library()
    rng = np.random.default_rng(5)
    metas = {cid: (f"t{cid}", Meta("allreduce", "float32", (cid + 1,), op=1)) for cid in range(5)}
    for calls in (0, 1, 7, 40):
        cids = rng.integers(0, 5, calls).tolist()
        starts = (10 ** 15 + np.cumsum(rng.integers(1, 10 ** 6, calls))).tolist()
        ends = [s + int(d) for s, d in zip(starts, rng.integers(0, 10 ** 5, calls))]
        rings = []
        for write in (None, module.fast_record):
            recorder = FlightRecorder(16, rank=0, size=2, directory="")
            recorder.begin("before", metas[0][1], 0.5)
            since = recorder.seq
            recorder.begin("after", metas[1][1], 20.0)
            recorder.add_finished(metas, cids, starts, ends, since, write)
            rings.append((recorder.seq, [None if e is None else list(e) for e in recorder._ring]))
        assert rings[0] == rings[1], calls
        assert module.fast_durations(starts, ends) == [(e - s) * 1e-9 for s, e in zip(starts, ends)]
    with pytest.raises(KeyError):
        module.fast_record([None] * 4, 0, metas, [9], [1], [2])
    with pytest.raises(ValueError):
        module.fast_record([None] * 3, 0, metas, [1], [1], [2])        # not a power of two
