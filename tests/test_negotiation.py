"""The coordinator's decisions, without MPI: readiness, order, fusion, mismatch messages, stalls, join, shutdown."""
from ringtrain.negotiation import Coordinator, Meta
from ringtrain.ops import ReduceOp


def meta(shape=(4,), dtype="float32", op=ReduceOp.SUM, kind="allreduce", **kw):
    return Meta(kind=kind, dtype=dtype, shape=shape, op=int(op), **kw)


def make(size=3, fusion=1 << 20, clock=None):
    return Coordinator(size, fusion, stall_warning_s=1.0, stall_timeout_s=2.0, clock=clock or (lambda: 0.0))


def test_ready_only_when_every_rank_submitted():
    c = make()
    c.submit(0, [("a", meta())])
    c.submit(1, [("a", meta())])
    assert c.plan() == []
    c.submit(2, [("a", meta())])
    assert c.plan() == [("allreduce", ["a"], [meta()])]
    assert c.plan() == []


def test_different_submission_orders_give_one_order_and_one_bucket():
    c = make(size=2)
    c.submit(0, [("a", meta()), ("b", meta())])
    c.submit(1, [("b", meta()), ("a", meta())])
    assert c.plan() == [("allreduce", ["a", "b"], [meta(), meta()])]


def test_fusion_threshold_splits_buckets_and_keys_by_dtype():
    c = make(size=1, fusion=40)
    c.submit(0, [("a", meta((8,))), ("b", meta((4,))), ("c", meta((2,), dtype="float64"))])
    names = [a[1] for a in c.plan()]
    assert names == [["a"], ["b"], ["c"]]   # a (32 B) + b (16 B) > 40 B; c has another dtype


def test_mismatch_names_every_rank_and_value():
    c = make()
    c.submit(0, [("w", meta((4,)))])
    c.submit(1, [("w", meta((5,)))])
    c.submit(2, [("w", meta((4,)))])
    [(kind, names, message, cls)] = c.plan()
    assert (kind, names, cls) == ("error", ["w"], "TensorMismatchError")
    assert "ranks 0,2 have allreduce shape (4,) float32" in message and "rank 1 has allreduce shape (5,)" in message


def test_dtype_op_and_root_mismatch_are_errors():
    for a, b in [(meta(dtype="float32"), meta(dtype="float64")), (meta(op=ReduceOp.SUM), meta(op=ReduceOp.MAX)),
                 (meta(kind="broadcast", root=0, op=-1), meta(kind="broadcast", root=1, op=-1))]:
        c = make(size=2)
        c.submit(0, [("x", a)])
        c.submit(1, [("x", b)])
        assert c.plan()[0][0] == "error"


def test_allgather_allows_different_first_dim():
    c = make(size=2)
    c.submit(0, [("g", meta((2, 3), kind="allgather", op=-1))])
    c.submit(1, [("g", meta((5, 3), kind="allgather", op=-1))])
    assert c.plan() == [("allgather", "g", meta((2, 3), kind="allgather", op=-1), [2, 5])]


def test_cache_ids_replace_metadata():
    c = make(size=2)
    c.submit(0, [("a", meta())])
    c.submit(1, [("a", meta())])
    c.plan()
    ids = c.take_new_cache_entries()
    assert ids == {("a", meta()): 0}
    c.submit(0, [0])
    c.submit(1, [0])
    assert c.plan() == [("allreduce", ["a"], [meta()])]


def test_stall_warns_then_fails_naming_missing_ranks():
    now = [0.0]
    c = make(clock=lambda: now[0])
    c.submit(0, [("s", meta())])
    c.submit(2, [("s", meta())])
    now[0] = 1.5
    warnings, fatal = c.check_stalls()
    assert fatal is None and "still missing on rank 1" in warnings[0]
    now[0] = 2.5
    warnings, fatal = c.check_stalls()
    assert warnings == [] and "not by rank 1" in fatal


def test_joined_rank_counts_as_ready_for_allreduce_only():
    c = make(size=2)
    c.join(1)
    c.submit(0, [("a", meta()), ("g", meta((1,), kind="allgather", op=-1))])
    actions = c.plan()
    assert actions[0][0] == "error" and "joined" in actions[0][2]
    assert ("allreduce", ["a"], [meta()]) in actions
    c.join(0)
    assert c.plan() == [("join_done", 0)]


def test_shutdown_rank_makes_pending_names_fail():
    c = make(size=2)
    c.shutdown(1)
    c.submit(0, [("a", meta())])
    [(kind, names, message, cls)] = c.plan()
    assert kind == "error" and cls == "RankFailureError" and "rank 1 already called shutdown()" in message
    c.shutdown(0)
    assert c.plan() == [("shutdown",)]
