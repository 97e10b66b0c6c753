"""The framework-neutral reducer on one process: its plan, pass counting, scaling rule, names and both collectives
(allreduce buckets, and the reducescatter buckets a sharded optimizer uses), with numpy arrays as the tensors."""
import numpy as np
import pytest

import ringtrain as rt
from ringtrain.errors import RingtrainError
from ringtrain.reducer.reducer import (Collective, Layout, Member, Phase, Reducer, Scaling, StepState, explicit_groups,
                               instance_prefix, plan_buckets)


@pytest.fixture(scope="module")
def one_rank():
    rt.init()
    yield
    rt.shutdown()


def members(*sizes, kind="f4", host=True):
    return [Member(f"m{i}", f"m{i}", nbytes, kind, host) for i, nbytes in enumerate(sizes)]


def keys(buckets):
    return [[m.key for m in bucket] for bucket in buckets]


def test_scaling_is_horovods_predivide_rule():
    assert Scaling.for_gradients(rt.Average, 4) == Scaling(rt.Average, 0.25, 4.0)
    assert Scaling.for_gradients(rt.Average, 4).kwargs() == {"prescale_factor": 0.25, "postscale_factor": 4.0}
    assert Scaling.for_gradients("sum").kwargs() == {} and Scaling.for_gradients("sum").op == rt.Sum
    with pytest.raises(ValueError, match="needs op=Average"):
        Scaling.for_gradients(rt.Sum, 2.0)
    assert Scaling(rt.Sum, 0.5, 3.0).local_factor() == 1.5


def test_plan_small_first_bucket_one_kind_each_large_host_members_alone():
    plan = plan_buckets(members(600, 600, 600, 600) + [Member("d", "d", 16, "f8")], first_bucket_bytes=1000,
                        bucket_bytes=2000)
    assert keys(plan) == [["m0"], ["m1", "m2", "m3"], ["d"]]
    alone = plan_buckets(members(10, 5000, 10) + [Member("gpu", "gpu", 5000, "f4", host=False)], 1 << 20, 1 << 20,
                         alone_bytes=4096)
    assert keys(alone) == [["m0"], ["m1"], ["m2", "gpu"]]          # a device member never travels alone
    packed = plan_buckets(members(10) + [Member("d", "d", 8, "f8")] + members(10, 10)[1:], 100, 100,
                          keep_order=False)
    assert keys(packed) == [["m0", "m1"], ["d"]]


def test_groups_are_the_users_buckets():
    ms = members(4, 4, 4, 4, 4)
    assert keys(explicit_groups(ms, 2)) == [["m0", "m1", "m2"], ["m3", "m4"]]
    by_key = [m.key for m in ms]          # groups name the binding's own objects (parameters), by identity
    assert keys(explicit_groups(ms, [[by_key[1], by_key[3]]])) == [["m1", "m3"], ["m0"], ["m2"], ["m4"]]
    assert explicit_groups(ms, 0) is None
    with pytest.raises(ValueError, match="one group only"):
        explicit_groups(ms, [[by_key[1]], [by_key[1]]])


def test_pass_counting_completes_a_bucket_after_every_member_arrived_k_times():
    reducer = Reducer(members(4, 4), prefix="t", passes_per_step=2, overlap=True)
    (bucket,) = reducer.buckets
    assert reducer.phase is Phase.LEARNING_ORDER and reducer.layout is Layout.GUESSED
    m0, m1 = (m.key for m in reducer.members)
    assert [reducer.arrived(k) for k in (m1, m0, m1)] == [None, None, None]
    assert reducer.arrived(m0) is bucket                        # the 4th arrival completes it
    assert [m.key for m in reducer.ready_order] == ["m1", "m0"]  # each counted at its k-th arrival
    reducer.check_passes()
    reducer.arrived(m0)                                         # a third backward pass before step()
    with pytest.raises(RingtrainError, match="'m0' was computed 3 times, more than backward_passes_per_step=2"):
        reducer.check_passes()
    reducer.reset_step()
    assert not reducer.has_work()


def test_instance_prefix_counts_per_process_set():
    class FakeSet:
        process_set_id = 77
    first, second = instance_prefix("Thing"), instance_prefix("Thing")
    assert first != second and ".set" not in first
    assert instance_prefix("Thing", FakeSet()) == "Thing.set77.0"
    assert instance_prefix("Thing", FakeSet()) == "Thing.set77.1"


def test_allreduce_buckets_scale_once_and_relayout_in_ready_order(one_rank):
    reducer = Reducer(members(16, 16, 16), prefix=instance_prefix("ReducerTest"), scaling=Scaling(rt.Sum, 0.5, 3.0),
                      first_bucket_bytes=16, bucket_bytes=16, overlap=True)
    arrays = {m.key: np.full(4, 2.0, np.float32) for m in reducer.members}
    m0, m1, m2 = (m.key for m in reducer.members)
    for key in (m0, m2, m1):                                    # the observed order differs from the guess
        bucket = reducer.arrived(key)
        reducer.submit(bucket, [arrays[key]])
    reducer.wait()
    for array in arrays.values():
        np.testing.assert_array_equal(array, np.full(4, 3.0))    # 2 * 0.5 * 3, on one rank
    reducer.learn_order()
    reducer.reset_step()
    reducer.mark_synchronized()
    assert reducer.state is StepState.SYNCHRONIZED and reducer.is_synchronized()
    assert reducer.layout is Layout.OBSERVED and keys(b.members for b in reducer.buckets) == [["m0"], ["m2"], ["m1"]]
    assert [b.name.split(".", 1)[1] for b in reducer.buckets] == ["g1.bucket0", "g1.bucket1", "g1.bucket2"]
    assert reducer.last_ready(reducer.buckets[1]).key == "m2"


def test_reducescatter_buckets_hand_each_rank_its_shard(one_rank):
    reducer = Reducer(members(32), prefix=instance_prefix("ReducerTest"), scaling=Scaling.for_gradients(rt.Average, 2),
                      collective=Collective.REDUCESCATTER, overlap=False)
    (bucket,) = reducer.buckets
    shards = []
    reducer.submit(bucket, [np.arange(8, dtype=np.float32)], done=shards.append)
    reducer.wait()
    np.testing.assert_array_equal(shards[0], np.arange(8))      # one rank: the whole bucket, predivide undone
    with pytest.raises(ValueError, match="one flat array"):
        reducer.submit(bucket, [np.zeros(2), np.zeros(2)])
