"""One process, no mpiexec: every collective is the identity (with scales), through the real engine."""
import numpy as np
import pytest

import ringtrain as rt


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    rt.init()
    yield
    rt.shutdown()


def test_allreduce_is_identity_with_scales_and_in_place():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(rt.allreduce(x, op=rt.Average), x)
    np.testing.assert_array_equal(rt.allreduce(x, prescale_factor=2.0, postscale_factor=0.25), x * 0.5)
    y = x.copy()
    assert rt.allreduce_async(y, op=rt.Sum, out=y).wait() is y
    np.testing.assert_array_equal(y, x)
    ints = rt.grouped_allreduce([np.array([5, -5], np.int64), np.ones(0, np.int8)], op=rt.Average)
    np.testing.assert_array_equal(ints[0], [5, -5])


def test_other_collectives_on_one_rank():
    x = np.arange(6, dtype=np.int32).reshape(3, 2)
    np.testing.assert_array_equal(rt.allgather(x), x)
    np.testing.assert_array_equal(rt.broadcast(x, root_rank=0), x)
    got, splits = rt.alltoall(x)
    np.testing.assert_array_equal(got, x)
    assert splits == [3]
    np.testing.assert_array_equal(rt.reducescatter(x, op=rt.Sum), x)
    assert rt.broadcast_object({"k": 1}) == {"k": 1} and rt.allgather_object(3) == [3]
    rt.barrier()
    assert rt.join() == 0


def test_queries_and_errors():
    assert (rt.rank(), rt.size(), rt.local_rank(), rt.local_size(), rt.cross_size()) == (0, 1, 0, 1, 1)
    with pytest.raises(ValueError, match="out of range"):
        rt.broadcast(np.ones(2), root_rank=1)


def _solo_calls(rng, dtype):
    """Every allreduce form at one rank over one dtype: (label, call) pairs, each call returning arrays."""
    bools = dtype == np.bool_
    base = (rng.random(37) > 0.5) if bools else (rng.standard_normal(37) * 50).astype(dtype)
    ops = [rt.Min, rt.Max] + ([] if bools else [rt.Sum, rt.Average, rt.Product])
    calls = []
    for op in ops:
        for post in (1.0,) if bools else (1.0, 0.375):
            for pre in (1.0,) if bools else (1.0, 3.0):
                scales = dict(op=op, prescale_factor=pre, postscale_factor=post)
                calls.append((f"{op} {pre} {post} out", lambda s=scales: [rt.allreduce(base.copy(), name="s1", **s)]))
                calls.append((f"{op} {pre} {post} unnamed", lambda s=scales: [rt.allreduce(base.copy(), **s)]))

                def in_place(s=scales):
                    y = base.copy()
                    assert rt.allreduce(y, out=y, name="s2", **s) is y
                    return [y]

                def grouped(s=scales):
                    parts = [base[:5].copy(), base[5:].copy()]
                    return rt.grouped_allreduce(parts, name="s3", **s)

                def grouped_big(s=scales):      # past the packing size: a Segments express call
                    parts = [np.resize(base, 20000), np.resize(base, 3)]
                    return rt.grouped_allreduce(parts, name="s4", **s)

                def deferred(s=scales):
                    y = base.copy()
                    return [rt.allreduce_async(y, out=y, name="s5", **s).wait()]
                calls += [(f"{op} {pre} {post} in place", in_place), (f"{op} {pre} {post} grouped", grouped),
                          (f"{op} {pre} {post} grouped big", grouped_big), (f"{op} {pre} {post} async", deferred)]
    return calls


def test_one_rank_express_path_equals_the_general_path_bit_for_bit(monkeypatch):
    """A communicator of one rank answers an allreduce with no cycle (engine/solo.py): the same bits as the general
    path (queue, coordinator, executor), for every op, scale, form and dtype -- and it really ran."""
    from ringtrain.core.routing import route
    from ringtrain.ops import DTYPES
    engine = route(None).engine
    solo = type(engine.agreement)
    answered, unanswered, label_now = set(), [], [None]
    real = solo.express

    def counting(self, *args, **kwargs):
        action = real(self, *args, **kwargs)
        (answered.add(label_now[0]) if action is not None else unanswered.append(label_now[0]))
        return action
    sync_forms = ("out", "unnamed", "in place", "grouped", "grouped big")
    for key, dtype in [(k, d) for k, d in DTYPES.items() if k != "bfloat16"]:
        rng = np.random.default_rng(7)
        calls = _solo_calls(rng, dtype)
        monkeypatch.setattr(solo, "express", counting)
        for _ in range(2):       # the second call of each name reuses its Collective
            fast = []
            for label, call in calls:
                label_now[0] = (key, label)
                fast.append([np.array(a) for a in call()])
        monkeypatch.setattr(solo, "express", lambda *a, **k: None)       # the general path, as before
        general = [[np.array(a) for a in call()] for _, call in calls]
        for (label, _), f, g in zip(calls, fast, general):
            for a, b in zip(f, g):
                assert a.dtype == b.dtype == dtype and a.tobytes() == b.tobytes(), (dtype, label, a, b)
        # it really ran: every synchronous call without a prescale was answered there (prescaled grouped and async
        # calls take the general path at any size)
        missed = [label for label, _ in calls if label.split(" ", 3)[3] in sync_forms and label.split()[1] == "1.0"
                  and (key, label) not in answered]
        assert not missed, (key, missed)
    # every call that reached the express path was answered there
    assert not unanswered, unanswered[:10]
