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
    native = native_or_skip()._native
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


def test_a_skipped_call_still_stalls_naming_the_rank_and_tensor():
    """With a short stall timeout: the last rank skips a cached allreduce the others make in the native cycle."""
    rt.shutdown()
    rt.init(stall_timeout_s=2.0, stall_warning_s=1.0)
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
