"""The framework-neutral Reducer on N ranks, with numpy arrays as the tensors and the step's whole lifecycle
(gradient_ready / finalize, several backward passes per step, the order learned after the first step): results
against numpy references of Horovod's rules, where Sum and Average differ and a rank's shard is not the whole bucket.
Each rank's gradients depend on its rank, so a wrong op, scale, divisor or shard shows."""
import numpy as np
import pytest

import ringtrain as rt
from ringtrain.reducer.reducer import Collective, Member, Reducer, Scaling, instance_prefix

SIZES = (5, 1, 7, 3)          # elements per member: uneven, so buckets and shards have ragged edges


def gradient(rank, member, step, backward_pass):
    """What `rank` accumulates for `member` in one backward pass of `step` (float64: exact sums)."""
    n = SIZES[member]
    return (np.arange(n, dtype=np.float64) + 1) * (rank + 1) * (member + 2) + 0.25 * step - 0.5 * backward_pass


def expected(member, step, passes, op, predivide):
    """Horovod's rule: each rank's accumulated gradient, summed over the ranks, divided by the size for Average
    (a predivide factor divides before the sum and multiplies after: the same value)."""
    total = sum(gradient(r, member, step, p) for r in range(rt.size()) for p in range(passes))
    return total / rt.size() if op == rt.Average else total


def make_reducer(name, op, predivide, passes, overlap, collective=Collective.ALLREDUCE):
    grads = {m: np.zeros(n) for m, n in enumerate(SIZES)}
    members = [Member(m, f"w{m}", SIZES[m] * 8, "f8", True) for m in range(len(SIZES))]
    reducer = Reducer(members, prefix=instance_prefix(name), scaling=Scaling.for_gradients(op, predivide),
                      passes_per_step=passes, bucket_bytes=8 * 8, first_bucket_bytes=6 * 8, overlap=overlap,
                      collective=collective)
    return reducer, grads


def run_step(reducer, grads, step, passes, launch):
    reducer.launch = launch
    reducer.prepare_for_backward()
    for g in grads.values():
        g[:] = 0
    for p in range(passes):
        for m in reversed(range(len(SIZES))):            # backward: last layer first
            grads[m] += gradient(rt.rank(), m, step, p)
            reducer.gradient_ready(m)
    reducer.finalize()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op, predivide", [(rt.Sum, 1.0), (rt.Average, 1.0), (rt.Average, 4.0)])
@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("overlap", [True, False])
def test_allreduce_buckets_give_horovods_result_over_steps(op, predivide, passes, overlap):
    reducer, grads = make_reducer("ReducerRanks", op, predivide, passes, overlap)

    def launch(bucket, sync):
        arrays = [grads[m.key] for m in bucket.members]
        reducer.submit(bucket, arrays, sync=sync)

    for step in range(3):                                 # the first step learns the order, the rest use it
        run_step(reducer, grads, step, passes, launch)
        for m in range(len(SIZES)):
            np.testing.assert_allclose(grads[m], expected(m, step, passes, op, predivide), rtol=1e-12,
                                       err_msg=f"member {m}, step {step}, {op.name} predivide {predivide}")


def shard_of(array, rank, size):
    """The core's split of dim 0: as even as possible, the first ranks one row more."""
    counts = [len(array) // size + (r < len(array) % size) for r in range(size)]
    start = sum(counts[:rank])
    return array[start:start + counts[rank]]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op, predivide", [(rt.Sum, 1.0), (rt.Average, 1.0), (rt.Average, 2.0)])
def test_reducescatter_buckets_hand_each_rank_its_shard_of_the_reduced_bucket(op, predivide):
    """A sharded optimizer's buckets: each bucket's members packed flat, reduce-scattered; this rank receives
    exactly its block of the reduced bucket (not the whole bucket, not another rank's block)."""
    reducer, grads = make_reducer("ReducerRanksShards", op, predivide, 1, False, Collective.REDUCESCATTER)
    shards = {}

    def launch(bucket, sync):
        flat = np.concatenate([grads[m.key] for m in bucket.members])
        reducer.submit(bucket, [flat], sync=sync, done=lambda result, b=bucket.index: shards.__setitem__(b, result))

    for step in range(2):
        shards.clear()
        run_step(reducer, grads, step, 1, launch)
        for bucket in reducer.buckets:
            whole = np.concatenate([expected(m.key, step, 1, op, predivide) for m in bucket.members])
            np.testing.assert_allclose(shards[bucket.index], shard_of(whole, rt.rank(), rt.size()), rtol=1e-12,
                                       err_msg=f"bucket {bucket.index}, step {step}")
