"""A job may use any number of distinct names: every name-keyed structure of the engine is bounded
(RINGTRAIN_CACHE_CAPACITY) and evicts in an order every rank agrees on. Run here with a tiny capacity, so a few
hundred names go far past it."""
import numpy as np
import pytest

import ringtrain as rt
from ringtrain.engine import agreement as agreement_module
from ringtrain.core import state

pytestmark = pytest.mark.mpi(min_size=2)

CAPACITY = 64


@pytest.fixture(scope="module")
def small_cache():
    rt.shutdown()
    rt.init(cache_capacity=CAPACITY)
    yield
    rt.shutdown()
    rt.init()


def _check_bounded():
    agreement = state.engine().agreement
    assert len(agreement.cache) <= CAPACITY
    assert agreement.cache.highest < CAPACITY
    if agreement.coordinator is not None:
        assert len(agreement.coordinator.cache) <= CAPACITY
        assert len(agreement.coordinator.cache.keys) <= CAPACITY


def test_allgathers_with_a_new_name_per_batch_and_rank_dependent_rows(small_cache):
    """The loop that crashed every engine at 4 ranks: one cache entry per (name, rank's shape)."""
    rank, size = rt.rank(), rt.size()
    want = np.ones(sum(1 + q % 3 for q in range(size)), np.float32)
    for b in range(150):
        handles = [rt.allgather_async(np.ones(1 + rank % 3, np.float32), name=f"churn.m{b}.{i}") for i in range(4)]
        for h in handles:
            np.testing.assert_array_equal(h.wait(), want)
    _check_bounded()


def test_cached_names_keep_working_while_new_names_evict_others(small_cache):
    """Names used every step stay correct -- and cached under the same ids: eviction takes the least recently used,
    and rank 0 sees every use, also of the steps agreed on the fast path without it -- while churn evicts around
    them. Each step: the cached names alone (the fast path), then as many new names mixed with some of them, in an
    order that differs per rank, then a synchronous call of a cached name (the express path)."""
    rank, size = rt.rank(), rt.size()
    steady = [f"churn.steady.{k}" for k in range(CAPACITY // 4)]
    total = size * (size + 1) // 2
    agreement = state.engine().agreement
    steady_ids = None

    def run(names, indices, rng):
        handles = {}
        for i in rng.permutation(indices):
            x = np.full(1 + i % 5, rank + 1, np.float32)
            if i % 3 == 0:
                handles[i] = rt.broadcast_async(x, root_rank=i % size, name=names[i])
            else:
                handles[i] = rt.allreduce_async(x, op=rt.Sum, name=names[i])
        for i, h in handles.items():
            want = np.full(1 + i % 5, (i % size) + 1 if i % 3 == 0 else total, np.float32)
            np.testing.assert_array_equal(h.wait(), want, err_msg=f"step {step} {names[i]}")

    for step in range(40):
        if step == 2:      # cached by now: used every step, they are never the least recently used
            steady_ids = {key: cid for key, cid in agreement.cache.ids.items()
                          if key[0] in steady and key[1].dtype == "float32"}     # the ones used every step
        rng = np.random.default_rng([step, rank])
        # 16 steady + 16 new names a step: the working set (steady, last step's and this step's new) fits
        names = steady + [f"churn.new.{step}.{k}" for k in range(CAPACITY // 4)]
        run(names, np.arange(len(steady)), rng)
        run(names, np.arange(len(steady) // 2, len(names)), rng)
        np.testing.assert_array_equal(rt.allreduce(np.full(3, rank + 1.0), op=rt.Sum, name=steady[step % 8]),
                                      np.full(3, float(total)))
    _check_bounded()
    if not agreement.synchronous:   # the coordinator protocol caches a name only while an evicted id is free
        return
    assert len(steady_ids) >= len(steady), sorted(set(steady) - {k[0] for k in steady_ids})
    now = {key: agreement.cache.ids.get(key) for key in steady_ids}
    assert now == steady_ids, f"rank {rank}: steady names evicted or renumbered: {steady_ids} -> {now}"


def test_evicted_name_comes_back_with_the_right_result(small_cache):
    rank, size = rt.rank(), rt.size()
    first = rt.allreduce(np.full(7, rank + 1.0), op=rt.Sum, name="churn.comeback")
    for k in range(2 * CAPACITY):                 # push it out of the cache
        rt.allreduce(np.full(2, 1.0), op=rt.Sum, name=f"churn.push.{k}")
    agreement = state.engine().agreement
    assert not any(key[0] == "churn.comeback" for key in agreement.cache.ids)
    again = rt.allreduce(np.full(7, rank + 1.0), op=rt.Sum, name="churn.comeback")
    np.testing.assert_array_equal(first, again)
    np.testing.assert_array_equal(again, np.full(7, size * (size + 1) / 2))


def test_coordinator_protocol_evicts_without_losing_an_id_in_flight(small_cache, monkeypatch):
    """Beyond MESSAGE_CYCLE_MAX_RANKS ranks across nodes every decision goes through rank 0 asynchronously: a rank
    may name an id rank 0 has just evicted. Forced here on two pretend nodes."""
    monkeypatch.setattr(agreement_module, "MESSAGE_CYCLE_MAX_RANKS", 1)
    rt.shutdown()
    rt.init(cache_capacity=CAPACITY, simulate_nodes=2)
    try:
        assert type(state.engine().agreement) is agreement_module.CoordinatorAgreement
        test_allgathers_with_a_new_name_per_batch_and_rank_dependent_rows(None)
        test_cached_names_keep_working_while_new_names_evict_others(None)
    finally:
        rt.shutdown()
        rt.init(cache_capacity=CAPACITY)


def test_a_reused_id_runs_the_new_names_collective(small_cache):
    """Each name is broadcast twice (the second time by id on the fast path), then never again: every id is soon
    handed to a new name, whose cached run must be its own collective, not the evicted name's."""
    rank, size = rt.rank(), rt.size()
    for k in range(3 * CAPACITY):
        for repeat in range(2):
            got = rt.broadcast(np.full(2, float(rank + k)), root_rank=k % size, name=f"churn.reused.{k}")
            np.testing.assert_array_equal(got, np.full(2, float(k % size + k)), err_msg=f"name {k} call {repeat}")
    _check_bounded()


def test_recurring_calls_survive_the_eviction_of_their_cache_entry(small_cache):
    """The express memo keeps a call's cache id with the cache state it read it at: after churn evicted the entry
    (and gave its id to another name), the call is a first sighting again and its plan follows the new entry,
    also on a rank whose memo has forgotten the call (its peers' plans must not run ahead of it)."""
    rank, size = rt.rank(), rt.size()
    agreement, memo = state.engine().agreement, state.engine().memo
    x = np.full(4, rank + 1.0, np.float32)
    want = np.full(4, size * (size + 1) / 2, np.float32)
    for rnd in range(3):
        for _ in range(3):
            np.testing.assert_array_equal(rt.allreduce(x, op=rt.Sum, name="churn.memo"), want)
        for i in range(CAPACITY + 8):                      # every older entry goes
            rt.allreduce(np.ones(1 + i % 3, np.float32), op=rt.Sum, name=f"churn.memo.{rnd}.{i}")
        if rank == size - 1:
            memo.clear()
        for _ in range(3):
            np.testing.assert_array_equal(rt.allreduce(x, op=rt.Sum, name="churn.memo"), want,
                                          err_msg=f"rank {rank} round {rnd}")
        plans = [p for p in memo.plans.values() if p.name == "churn.memo"]
        assert len(plans) == 1
        plan = plans[0]
        assert plan.cid is not None and agreement.cache.keys[plan.cid] == (plan.name, plan.meta), \
            (rank, rnd, plan.cid, agreement.cache.keys.get(plan.cid))
    _check_bounded()
