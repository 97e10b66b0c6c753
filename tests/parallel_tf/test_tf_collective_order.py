"""Independent collectives in one graph run in whatever order TensorFlow's executor picks, which differs between
ranks: here each rank even creates them in its own order. None may hold a TF thread while it waits for the other
ranks, or the job stalls. Results vs numpy, in a tf.compat.v1 Graph + Session and in tf.function (the launcher
runs this file at 2, 3 and 4 ranks with a short stall timeout, so a deadlock fails fast)."""
import numpy as np
import pytest
import tensorflow as tf

import ringtrain.tensorflow as hvd

KINDS = ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter")
PER_KIND = 4          # 20 independent collectives


def value(rank, kind, i, rows):
    return (np.arange(rows * 3, dtype=np.float32).reshape(rows, 3) + 10 * rank + 100 * i + 1000 * KINDS.index(kind))


def rows_of(rank, kind, n):
    if kind == "allgather":
        return rank + 1                  # dim 0 differs per rank
    return 2 * n + 1                     # does not divide by the rank count (reducescatter, alltoall)


def splits_of(rank, n, rows):
    """alltoall: rank r sends rows to each rank, unevenly and differently per rank."""
    base = [rows // n] * n
    base[rank % n] += rows - sum(base)
    return base


def expected(kind, i, n, r):
    everyone = [value(k, kind, i, rows_of(k, kind, n)) for k in range(n)]
    if kind == "allreduce":
        return np.sum(everyone, axis=0)
    if kind == "allgather":
        return np.concatenate(everyone)
    if kind == "broadcast":
        return everyone[i % n]
    if kind == "reducescatter":
        total = np.sum(everyone, axis=0)
        rows = total.shape[0]
        sizes = [rows // n + (1 if k < rows % n else 0) for k in range(n)]
        start = sum(sizes[:r])
        return total[start:start + sizes[r]]
    # alltoall: rank k's block for r, concatenated by k
    blocks = []
    for k in range(n):
        splits = splits_of(k, n, everyone[k].shape[0])
        start = sum(splits[:r])
        blocks.append(everyone[k][start:start + splits[r]])
    return np.concatenate(blocks)


def build(n, r, prefix):
    """{(kind, i): output tensor}, created in an order of this rank's own."""
    jobs = [(kind, i) for kind in KINDS for i in range(PER_KIND)]
    order = np.random.default_rng(1000 + r).permutation(len(jobs))
    if r % 2:
        order = order[::-1]
    outputs = {}
    for j in order:
        kind, i = jobs[j]
        x = tf.constant(value(r, kind, i, rows_of(r, kind, n)))
        name = f"{prefix}.{kind}.{i}"
        if kind == "allreduce":
            out = hvd.allreduce(x, op=hvd.Sum, name=name)
        elif kind == "allgather":
            out = hvd.allgather(x, name=name)
        elif kind == "broadcast":
            out = hvd.broadcast(x, root_rank=i % n, name=name)
        elif kind == "alltoall":
            out, _ = hvd.alltoall(x, splits=splits_of(r, n, x.shape[0]), name=name)
        else:
            out = hvd.reducescatter(x, op=hvd.Sum, name=name)
        outputs[(kind, i)] = out
    return outputs


def check(results, n, r):
    assert len(results) == len(KINDS) * PER_KIND
    for (kind, i), got in results.items():
        np.testing.assert_allclose(np.asarray(got), expected(kind, i, n, r), err_msg=f"{kind} {i}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_independent_collectives_in_any_order_v1_graph():
    n, r = hvd.size(), hvd.rank()
    graph = tf.Graph()
    with graph.as_default():
        outputs = build(n, r, "order.graph")
        keys = list(outputs)
        config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=2, intra_op_parallelism_threads=1)
        with tf.compat.v1.Session(graph=graph, config=config) as session:
            values = session.run([outputs[k] for k in keys])
            check(dict(zip(keys, values)), n, r)
            again = session.run([outputs[k] for k in keys])      # a second run of the same graph
            check(dict(zip(keys, again)), n, r)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_independent_collectives_in_any_order_tf_function():
    n, r = hvd.size(), hvd.rank()

    @tf.function
    def step():
        return {f"{kind}.{i}": out for (kind, i), out in build(n, r, "order.function").items()}

    for _ in range(2):
        results = {tuple(k.split(".")[:1]) + (int(k.split(".")[1]),): v.numpy() for k, v in step().items()}
        check(results, n, r)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_issue_minimal_allgathers_in_a_v1_graph():
    """Horovod's users' plain case: 16 allgathers with automatic names, summed."""
    n = hvd.size()
    graph = tf.Graph()
    with graph.as_default():
        outs = [hvd.allgather(tf.ones([17]) * float(i)) for i in range(16)]
        total = tf.add_n([tf.reduce_sum(o) for o in outs])
        with tf.compat.v1.Session(graph=graph) as session:
            assert session.run(total) == pytest.approx(17 * n * sum(range(16)))
