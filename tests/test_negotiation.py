"""The coordinator's decisions, without MPI: readiness, order, fusion, mismatch messages, stalls, join, shutdown."""
from ringtrain.engine.model import Collective, Failed, JoinDone, Meta, Shutdown
from ringtrain.engine.negotiation import Coordinator
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
    assert c.plan() == [Collective("allreduce", ("a",), (meta(),))]
    assert c.plan() == []


def test_different_submission_orders_give_one_order_and_one_bucket():
    c = make(size=2)
    c.submit(0, [("a", meta()), ("b", meta())])
    c.submit(1, [("b", meta()), ("a", meta())])
    assert c.plan() == [Collective("allreduce", ("a", "b"), (meta(), meta()))]


def test_fusion_threshold_splits_buckets_and_keys_by_dtype():
    c = make(size=1, fusion=40)
    c.submit(0, [("a", meta((8,))), ("b", meta((4,))), ("c", meta((2,), dtype="float64"))])
    names = [list(a.names) for a in c.plan()]
    assert names == [["a"], ["b"], ["c"]]   # a (32 B) + b (16 B) > 40 B; c has another dtype


def test_mismatch_names_every_rank_and_value():
    c = make()
    c.submit(0, [("w", meta((4,)))])
    c.submit(1, [("w", meta((5,)))])
    c.submit(2, [("w", meta((4,)))])
    [action] = c.plan()
    names, message, cls = action.names, action.message, action.error
    assert isinstance(action, Failed) and (names, cls) == (("w",), "TensorMismatchError")
    assert "ranks 0,2 have allreduce shape (4,) float32" in message and "rank 1 has allreduce shape (5,)" in message


def test_dtype_op_and_root_mismatch_are_errors():
    for a, b in [(meta(dtype="float32"), meta(dtype="float64")), (meta(op=ReduceOp.SUM), meta(op=ReduceOp.MAX)),
                 (meta(kind="broadcast", root=0, op=-1), meta(kind="broadcast", root=1, op=-1))]:
        c = make(size=2)
        c.submit(0, [("x", a)])
        c.submit(1, [("x", b)])
        assert isinstance(c.plan()[0], Failed)


def test_allgather_allows_different_first_dim():
    c = make(size=2)
    c.submit(0, [("g", meta((2, 3), kind="allgather", op=-1))])
    c.submit(1, [("g", meta((5, 3), kind="allgather", op=-1))])
    assert c.plan() == [Collective("allgather", ("g",), (meta((2, 3), kind="allgather", op=-1),), first_dims=(2, 5))]


def test_cache_ids_replace_metadata():
    c = make(size=2)
    c.submit(0, [("a", meta())])
    c.submit(1, [("a", meta())])
    c.plan()
    ids = c.take_new_cache_entries()
    assert ids == [(0, ("a", meta()))]
    c.submit(0, [0])
    c.submit(1, [0])
    assert c.plan() == [Collective("allreduce", ("a",), (meta(),))]


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
    assert warnings == [] and "not by rank 1" in fatal.message
    assert fatal.names == ("s",) and fatal.error == "StallError" and not c.pending     # dropped from the book


def test_joined_rank_counts_as_ready_for_allreduce_only():
    c = make(size=2)
    c.join(1)
    c.submit(0, [("a", meta()), ("g", meta((1,), kind="allgather", op=-1))])
    actions = c.plan()
    assert isinstance(actions[0], Failed) and "joined" in actions[0].message
    assert Collective("allreduce", ("a",), (meta(),)) in actions
    c.join(0)
    assert c.plan() == [JoinDone(0)]


def test_shutdown_rank_makes_pending_names_fail():
    c = make(size=2)
    c.shutdown(1)
    c.submit(0, [("a", meta())])
    [action] = c.plan()
    message, cls = action.message, action.error
    assert isinstance(action, Failed) and cls == "RankFailureError" and "rank 1 already called shutdown()" in message
    c.shutdown(0)
    assert c.plan() == [Shutdown()]


def test_fusion_is_a_pure_function_of_the_ready_list():
    """The coordinator-free fast path fuses on every rank independently: same list in, same buckets out."""
    from ringtrain.engine.negotiation import fuse_allreduces
    items = [("a", meta((8,))), ("h", meta((4,), dtype="float16")), ("b", meta((4,))), ("c", meta((8,)))]
    buckets = fuse_allreduces(items, threshold=48, size=2)
    assert [(a.names, a.metas[0].dtype) for a in buckets] == [(("a", "b"), "float32"), (("h",), "float16"),
                                                               (("c",), "float32")]
    assert fuse_allreduces(items, threshold=48, size=2) == buckets


def test_grouped_parts_are_part_of_the_agreement():
    c = make(size=2)
    c.submit(0, [("g", meta((6,), parts=(2, 4)))])
    c.submit(1, [("g", meta((6,), parts=(3, 3)))])
    [action] = c.plan()
    assert action.error == "TensorMismatchError", action
    assert "rank 0 has allreduce shape (6,) float32 op Sum in 2 tensors of 2, 4 elements" in action.message
    assert "rank 1 has allreduce shape (6,) float32 op Sum in 2 tensors of 3, 3 elements" in action.message


def test_long_groups_that_differ_only_inside_read_differently():
    same_ends = [(1, 2, 3) + middle + (7, 8, 9) for middle in ((4, 5), (5, 4))]
    c = make(size=2)
    for rank, parts in enumerate(same_ends):
        c.submit(rank, [("g", meta((39,), parts=parts))])
    [action] = c.plan()
    assert action.error == "TensorMismatchError", action
    rank0, rank1 = action.message.split("; ")
    assert "rank 0 has" in rank0 and "rank 1 has" in rank1, action.message
    for described in (rank0, rank1):
        assert "in 8 tensors of 1, 2, 3, ..., 7, 8, 9 elements (checksum " in described, action.message
    assert rank0.split("checksum")[1] != rank1.split("checksum")[1], action.message


def test_a_fatal_stall_names_every_name_waiting_past_the_warning():
    now = [0.0]
    c = make(size=2, clock=lambda: now[0])
    c.submit(0, [("grad.a", meta())])
    now[0] = 0.2
    c.submit(1, [("grad.b", meta())])
    now[0] = 2.1                      # grad.a is past the 2 s timeout, grad.b (1.9 s) only past the warning
    _, fatal = c.check_stalls()
    assert "'grad.a' was submitted by rank 0 but not by rank 1" in fatal.message
    assert "'grad.b' was submitted by rank 1 but not by rank 0" in fatal.message
    # the oldest side ends now; the other side's name waits a full timeout more (its ranks may have skipped
    # grad.a, and then grad.b is their next call, which rank 0 makes next), then ends the same way
    assert fatal.names == ("grad.a",) and list(c.pending) == ["grad.b"]
    now[0] = 3.0
    c.submit(0, [("grad.b", meta())])
    assert [a.names for a in c.plan()] == [("grad.b",)]
    c.submit(1, [("grad.c", meta())])
    now[0] = 4.0
    assert c.check_stalls()[1] is None
    now[0] = 5.1
    _, fatal = c.check_stalls()
    assert fatal.names == ("grad.c",) and "'grad.c' was submitted by rank 1 but not by rank 0" in fatal.message


def test_a_stall_message_names_tensors_when_the_timeout_is_below_the_warning():
    now = [0.0]
    c = make(size=2, clock=lambda: now[0])
    c.stall_warning_s, c.stall_timeout_s = 60.0, 2.0
    c.submit(0, [("tf.allgather.7", meta())])
    now[0] = 2.5
    _, fatal = c.check_stalls()
    assert "tensor 'tf.allgather.7' was submitted by rank 0 but not by rank 1" in fatal.message, fatal
    assert fatal.names == ("tf.allgather.7",)


def _run(c, name, m=None, ranks=(0, 1)):
    for r in ranks:
        c.submit(r, [(name, m or meta())])
    return c.plan()


def test_cache_is_bounded_and_evicts_the_least_recently_used():
    c = Coordinator(2, 1 << 20, 1.0, 2.0, clock=lambda: 0.0, cache_capacity=2)
    _run(c, "a")
    _run(c, "b")
    assert c.take_new_cache_entries() == [(0, ("a", meta())), (1, ("b", meta()))]
    c.submit(0, [0])                        # a used again (by id): b is now the least recently used
    c.submit(1, [0])
    c.plan()
    _run(c, "c")
    # b evicted, its id handed to c, in one update every rank applies in order
    assert c.take_new_cache_entries() == [(1, None), (1, ("c", meta()))]
    assert c.cache.get(("b", meta())) is None and c.cache.get(("a", meta())) == 0 and len(c.cache) == 2


def test_many_names_keep_ids_below_the_capacity():
    c = Coordinator(3, 1 << 20, 1.0, 2.0, clock=lambda: 0.0, cache_capacity=64)
    from ringtrain.engine.response_cache import CacheView
    views = [CacheView() for _ in range(3)]
    for k in range(5000):
        # an allgather with rank-dependent first dims: one entry per distinct Meta (3 ranks, 3 shapes)
        for r in range(3):
            c.submit(r, [(f"g{k}", meta((1 + r, 2), kind="allgather", op=-1))])
        c.plan()
        changes = c.take_new_cache_entries()
        for v in views:
            v.apply(changes)
    assert len(c.cache) <= 64 and all(len(v) == len(c.cache) for v in views)
    assert max(v.highest for v in views) < 64
    assert views[0].ids == views[2].ids == c.cache.ids


def test_capacity_zero_caches_nothing():
    c = Coordinator(2, 1 << 20, 1.0, 2.0, clock=lambda: 0.0, cache_capacity=0)
    assert _run(c, "a") == [Collective("allreduce", ("a",), (meta(),))]
    assert c.take_new_cache_entries() == [] and len(c.cache) == 0


def test_asynchronous_eviction_keeps_an_id_until_every_rank_applied_it():
    """The coordinator protocol: a rank may still name an evicted id in a message on its way; the id resolves to
    its old entry, and is not reused, until every rank said it applied the update that evicted it."""
    c = Coordinator(2, 1 << 20, 1.0, 2.0, clock=lambda: 0.0, cache_capacity=1, synchronous=False)
    _run(c, "a")
    assert c.take_new_cache_entries() == [(0, ("a", meta()))]       # update 1
    _run(c, "b")                                                       # evicts a; no free id for b yet
    assert c.take_new_cache_entries() == [(0, None)]                  # update 2
    c.submit(1, [0], updates=1)             # rank 1 had not applied update 2: id 0 still means a
    c.submit(0, [("a", meta())])
    assert [a.names for a in c.plan()] == [("a",)]
    assert c.cache.get(("a", meta())) is None                          # ... and a did not come back for id 0
    c.take_new_cache_entries()
    c.submit(1, [("b", meta())], updates=2)                            # now every rank applied update 2
    c.submit(0, [("b", meta())])
    c.plan()
    assert c.take_new_cache_entries() == [(0, ("b", meta()))]


def test_collectives_carry_the_scale_rule():
    """What multiplies inputs and result is decided once, with the action: Average's 1/N (N = every rank, joined
    ones included) times the postscale; the prescale on the inputs; nothing for non-reductions."""
    c = make(size=4)
    avg = meta(op=0, scales=(0.5, 3.0))
    for r in range(4):
        c.submit(r, [("avg", avg), ("b", meta(kind="broadcast", op=-1, root=1))])
    actions = {a.names: a for a in c.plan()}
    assert (actions[("avg",)].prescale, actions[("avg",)].scale) == (0.5, 0.75)
    assert (actions[("b",)].prescale, actions[("b",)].scale) == (1.0, 1.0)
    [bucket] = __import__("ringtrain.engine.negotiation").engine.negotiation.fuse_allreduces(
        [("x", meta(op=0)), ("y", meta(op=0))], threshold=1 << 20, size=2)
    assert bucket.names == ("x", "y") and bucket.scale == 0.5


def test_the_express_memo_is_bounded():
    from ringtrain.engine.express_memo import ExpressMemo, ExpressPlan
    memo = ExpressMemo(capacity=4)
    for i in range(11):
        plan = memo.put(("n", i), ExpressPlan(f"n{i}", meta()))
        assert memo.get(("n", i)) is plan and len(memo.plans) <= 4
    assert plan.generation == -1 and plan.nbytes == 16 and plan.cid is None
