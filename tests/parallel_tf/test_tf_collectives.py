"""ringtrain.tensorflow collectives on tf tensors vs a numpy reference, for every dtype, eagerly and in tf.function;
and their gradients vs the rules written in ringtrain/tensorflow/functions.py."""
import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

import ringtrain.tensorflow as hvd

DTYPES = [tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int8, tf.uint8, tf.int32, tf.int64, tf.bool]
MODES = ["eager", "graph"]


def rank_array(rank, dtype, rows=5, cols=3):
    """Distinct per rank, exact in every dtype (small integers)."""
    values = (np.arange(rows * cols).reshape(rows, cols) + 3 * rank) % 7
    if dtype == tf.bool:
        return values % 2 == 1
    return values.astype(ml_dtypes.bfloat16 if dtype == tf.bfloat16 else dtype.as_numpy_dtype)


def run(mode, fn, *args):
    return fn(*args) if mode == "eager" else tf.function(fn)(*args)


def as_numpy(t):
    return t.numpy().astype(np.float64) if t.dtype not in (tf.bool,) else t.numpy()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_allreduce_every_dtype(mode, dtype):
    n, r = hvd.size(), hvd.rank()
    everyone = [rank_array(k, dtype) for k in range(n)]
    x = tf.constant(everyone[r], dtype=dtype)
    if dtype == tf.bool:
        got = run(mode, lambda t: hvd.allreduce(t, op=hvd.Max, name=f"ar.{mode}.{dtype.name}"), x)
        np.testing.assert_array_equal(got.numpy(), np.logical_or.reduce(everyone))
        return
    got = run(mode, lambda t: hvd.allreduce(t, op=hvd.Sum, name=f"ar.{mode}.{dtype.name}"), x)
    assert got.dtype == dtype and got.shape == x.shape
    np.testing.assert_array_equal(as_numpy(got), np.sum([e.astype(np.float64) for e in everyone], axis=0))
    lowest = run(mode, lambda t: hvd.allreduce(t, op=hvd.Min, name=f"armin.{mode}.{dtype.name}"), x)
    np.testing.assert_array_equal(as_numpy(lowest), np.min([e.astype(np.float64) for e in everyone], axis=0))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_allgather_broadcast_alltoall_every_dtype(mode, dtype):
    n, r = hvd.size(), hvd.rank()
    mine = rank_array(r, dtype, rows=r + 1)          # dim 0 differs per rank
    gathered = run(mode, lambda t: hvd.allgather(t, name=f"ag.{mode}.{dtype.name}"), tf.constant(mine, dtype))
    expected = np.concatenate([rank_array(k, dtype, rows=k + 1) for k in range(n)])
    assert gathered.dtype == dtype
    np.testing.assert_array_equal(gathered.numpy(), expected)

    root = n - 1
    got = run(mode, lambda t: hvd.broadcast(t, root, name=f"bc.{mode}.{dtype.name}"),
              tf.constant(rank_array(r, dtype), dtype))
    np.testing.assert_array_equal(got.numpy(), rank_array(root, dtype))

    # rank r sends (j + 1) rows to rank j; row values say who sent them
    sends = np.concatenate([np.full((j + 1, 2), 10 * r + j) for j in range(n)])
    data = tf.constant(rank_array(0, dtype, rows=len(sends), cols=2) if dtype == tf.bool else
                       sends.astype(rank_array(0, dtype).dtype), dtype)
    received, received_splits = run(mode, lambda t: hvd.alltoall(t, splits=[j + 1 for j in range(n)],
                                                                  name=f"a2a.{mode}.{dtype.name}"), data)
    np.testing.assert_array_equal(received_splits.numpy(), [r + 1] * n)
    if dtype != tf.bool:
        expected = np.concatenate([np.full((r + 1, 2), 10 * k + r) for k in range(n)])
        np.testing.assert_array_equal(as_numpy(received), expected)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != tf.bool], ids=lambda d: d.name)
def test_reducescatter_every_dtype(mode, dtype):
    n, r = hvd.size(), hvd.rank()
    rows = 2 * n + 1                                  # does not divide: first blocks larger
    everyone = [rank_array(k, dtype, rows=rows) for k in range(n)]
    got = run(mode, lambda t: hvd.reducescatter(t, op=hvd.Sum, name=f"rs.{mode}.{dtype.name}"),
              tf.constant(everyone[r], dtype))
    total = np.sum([e.astype(np.float64) for e in everyone], axis=0)
    blocks = np.array_split(total, n)
    np.testing.assert_array_equal(as_numpy(got), blocks[r])


@pytest.mark.mpi(min_size=2)
def test_grouped_allreduce_and_compression():
    n, r = hvd.size(), hvd.rank()
    tensors = [tf.fill([k + 1], float(r + 1)) for k in range(3)] + [tf.constant([r], tf.int64)]
    got = hvd.grouped_allreduce(tensors, op=hvd.Sum, name="grouped")
    for k in range(3):
        np.testing.assert_array_equal(got[k].numpy(), [n * (n + 1) / 2] * (k + 1))
    assert got[3].numpy().tolist() == [n * (n - 1) // 2]
    for compression in (hvd.Compression.fp16, hvd.Compression.bf16):
        out = hvd.allreduce(tf.fill([7], 0.25 * (r + 1)), compression=compression, name=f"c.{compression.__name__}")
        assert out.dtype == tf.float32
        np.testing.assert_allclose(out.numpy(), 0.25 * (n + 1) / 2, rtol=1e-2)


def gradient_value(rank, index, shape, dtype):
    return (np.arange(int(np.prod(shape))).reshape(shape) % 11 * (index + 1) + 10 * rank).astype(dtype)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("shared", [False, True], ids=["copied", "shared_buffers"])
@pytest.mark.parametrize("mode", MODES)
def test_gradient_buckets_match_numpy(mode, shared):
    """allreduce_gradients, the path of DistributedGradientTape (copied results) and DistributedOptimizer (results
    in shared buffers): several buckets (a 256-byte cap) of two dtypes, a 0-d and an empty tensor among them, a None
    and a sparse gradient, and scales; every result against the numpy mean of the ranks' values."""
    from ringtrain.tensorflow.gradients import allreduce_gradients
    n, r = hvd.size(), hvd.rank()
    specs = [((3, 5), np.float32), ((), np.float64), ((0, 4), np.float32), ((17,), np.float32),
             ((64, 33), np.float64), ((2, 2), np.float32)]
    grads = [tf.constant(gradient_value(r, i, shape, dtype)) for i, (shape, dtype) in enumerate(specs)]
    sparse = tf.IndexedSlices(tf.constant([[float(r)]]), tf.constant([r], tf.int64), tf.constant([n, 1], tf.int64))
    grads = grads[:2] + [None] + grads[2:] + [sparse]
    reduced = run(mode, lambda: allreduce_gradients(grads, f"buckets.{mode}.{shared}", bucket_cap_mb=256 / (1 << 20),
                                                    prescale_factor=0.5, postscale_factor=3.0,
                                                    results_in_shared_buffers=shared))
    assert reduced[2] is None
    dense = reduced[:2] + reduced[3:-1]
    for i, ((shape, dtype), got) in enumerate(zip(specs, dense)):
        expected = 1.5 * np.mean([gradient_value(k, i, shape, np.float64) for k in range(n)], axis=0)
        assert got.shape == shape and got.dtype.as_numpy_dtype == dtype
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6)
    np.testing.assert_allclose(reduced[-1].values.numpy().ravel(), np.arange(n) / n)
    assert reduced[-1].indices.numpy().tolist() == list(range(n))


@pytest.mark.mpi(min_size=2)
def test_results_in_shared_buffers_live_until_the_call_after_next():
    """DistributedOptimizer's path: results are 64-byte-aligned views of two persistent buffers per bucket, used
    alternately -- call k's results are still right after call k+1, and call k+2 reuses call k's memory (no
    allocation per step, no copy into TensorFlow). Buckets of identical shapes in one call keep their own buffers."""
    from ringtrain.tensorflow.gradients import allreduce_gradients
    n, r = hvd.size(), hvd.rank()
    specs = [((3, 5), np.float32), ((7,), np.float32), ((), np.float32), ((64, 33), np.float32)]

    def call(k, specs=specs, **options):
        grads = [tf.constant(gradient_value(r + 5 * k, i, shape, dtype)) for i, (shape, dtype) in enumerate(specs)]
        return allreduce_gradients(grads, "lifetime", results_in_shared_buffers=True, **options)

    def check(k, results, specs=specs):
        for i, ((shape, _), got) in enumerate(zip(specs, results)):
            expected = np.mean([gradient_value(q + 5 * k, i, shape, np.float64) for q in range(n)], axis=0)
            np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6, err_msg=f"call {k}, tensor {i}")

    def addresses(results):
        return [np.from_dlpack(t).ctypes.data for t in results]

    first = call(0)
    second = call(1)
    check(0, first)
    check(1, second)
    assert all(a % 64 == 0 for a in addresses(first) + addresses(second))
    third = call(2)
    check(2, third)
    assert addresses(third) == addresses(first) and addresses(second) != addresses(first)
    # three buckets (a 256-byte cap), one (8, 8) float32 tensor each: same shapes, different buckets
    same = [((8, 8), np.float32)] * 3
    results = call(3, same, bucket_cap_mb=256 / (1 << 20))
    check(3, results, same)
    assert len(set(addresses(results))) == 3


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", MODES)
def test_process_set_collectives_and_gradients(mode):
    """Every collective on the set of all ranks but 0 (a set of one at 2 ranks, of two at 3) against numpy, with
    blocks ordered by rank in the set and the allgather gradient taking this rank's rows by its rank in the set;
    rank 0, outside the set, gets the core's error at once."""
    from ringtrain.tensorflow.gradients import allreduce_gradients
    n, r = hvd.size(), hvd.rank()
    members = list(range(1, n))
    process_set = hvd.add_process_set(members)
    try:
        if not process_set.included():
            with pytest.raises(ValueError, match="not a member of process set"):
                hvd.allreduce(tf.constant([1.0]), name="outside", process_set=process_set)
            return
        k, me = len(members), members.index(r)
        x = tf.fill([me + 1, 1], 1.0)

        def body():
            def tagged(kind):
                return dict(name=f"set.{kind}.{mode}", process_set=process_set)
            summed = hvd.allreduce(tf.constant([float(r), 1.0]), op=hvd.Sum, **tagged("sum"))
            gathered = hvd.allgather(tf.fill([me + 1, 2], float(r)), **tagged("gather"))
            root = hvd.broadcast(tf.constant([float(r)]), root_rank=members[-1], **tagged("broadcast"))
            scattered = hvd.reducescatter(tf.fill([2 * k + 1, 1], float(r)), op=hvd.Sum, **tagged("scatter"))
            received, splits = hvd.alltoall(tf.fill([k, 1], float(r)), **tagged("alltoall"))
            (mean,) = allreduce_gradients([tf.constant([float(r)])], f"set.grads.{mode}", process_set=process_set)
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = hvd.allgather(x, **tagged("gather_grad"))
                loss = tf.reduce_sum(y * tf.reshape(tf.range(tf.shape(y)[0], dtype=y.dtype), [-1, 1]))
            declared_rows = tf.constant(scattered.shape[0])     # in a graph: the shape declared at trace time
            return summed, gathered, root, scattered, declared_rows, received, splits, mean, tape.gradient(loss, x)

        summed, gathered, root, scattered, declared_rows, received, splits, mean, dx = run(mode, body)
        np.testing.assert_array_equal(summed.numpy(), [sum(members), k])
        np.testing.assert_array_equal(gathered.numpy(),
                                      np.concatenate([np.full((i + 1, 2), float(m)) for i, m in enumerate(members)]))
        assert root.numpy().tolist() == [float(members[-1])]
        rows = (2 * k + 1) // k + (1 if me < (2 * k + 1) % k else 0)
        np.testing.assert_array_equal(scattered.numpy(), np.full((rows, 1), float(sum(members))))
        assert int(declared_rows) == rows
        np.testing.assert_array_equal(received.numpy().ravel(), members)      # one row from every member
        assert splits.numpy().tolist() == [1] * k
        np.testing.assert_allclose(mean.numpy(), [np.mean(members)])
        offset = me * (me + 1) // 2                                          # rows of the members before me
        np.testing.assert_array_equal(dx.numpy().ravel(), np.arange(offset, offset + me + 1))
    finally:
        hvd.remove_process_set(process_set)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", MODES)
def test_scalar_and_empty_tensors_keep_their_shape(mode):
    n, r = hvd.size(), hvd.rank()
    scalar = run(mode, lambda t: hvd.allreduce(t, op=hvd.Sum, name=f"scalar.{mode}"), tf.constant(float(r)))
    assert scalar.shape == () and float(scalar) == n * (n - 1) / 2
    empty = run(mode, lambda t: hvd.allreduce(t, name=f"empty.{mode}"), tf.zeros([0, 3]))
    assert empty.shape == (0, 3)


@pytest.mark.mpi(min_size=2)
def test_indexed_slices_are_gathered():
    n, r = hvd.size(), hvd.rank()
    slices = tf.IndexedSlices(tf.fill([1, 2], float(r)), tf.constant([r]), dense_shape=tf.constant([n, 2]))
    got = hvd.allreduce(slices, op=hvd.Average, name="sparse")
    np.testing.assert_allclose(tf.convert_to_tensor(got).numpy(), [[k / n] * 2 for k in range(n)], rtol=1e-6)


# ---------------------------------------------------------------- gradients


def gradient(mode, forward, x):
    def compute(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = forward(x)
            # a per-rank weighting of the output, so the upstream gradient differs by rank
            loss = tf.reduce_sum(y * (tf.cast(tf.range(tf.size(y)), y.dtype) + 1.0) * (hvd.rank() + 1.0))
        return tape.gradient(loss, x)
    return run(mode, compute, x).numpy()


def upstream(rank, length):
    return (np.arange(length) + 1.0) * (rank + 1.0)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", MODES)
def test_gradients_follow_the_documented_rules(mode):
    n, r = hvd.size(), hvd.rank()
    x = tf.constant(np.arange(2 * n, dtype=np.float64) + r)
    length = 2 * n
    mean_upstream = np.mean([upstream(k, length) for k in range(n)], axis=0)

    g = gradient(mode, lambda t: hvd.allreduce(t, op=hvd.Average, name=f"g.ar.{mode}"), x)
    np.testing.assert_allclose(g, mean_upstream)
    g = gradient(mode, lambda t: hvd.allreduce(t, op=hvd.Sum, name=f"g.ars.{mode}"), x)
    np.testing.assert_allclose(g, mean_upstream * n)

    g = gradient(mode, lambda t: hvd.allgather(t, name=f"g.ag.{mode}"), x)
    gathered_upstream = np.mean([upstream(k, length * n) for k in range(n)], axis=0)
    np.testing.assert_allclose(g, gathered_upstream[r * length:(r + 1) * length])

    root = n - 1
    g = gradient(mode, lambda t: hvd.broadcast(t, root, name=f"g.bc.{mode}"), x)
    np.testing.assert_allclose(g, mean_upstream if r == root else np.zeros(length))

    g = gradient(mode, lambda t: hvd.alltoall(t, name=f"g.a2a.{mode}")[0], x)
    # received row i came from rank i // 2, row r*2 + i % 2 of its input: the reverse exchange sends it back
    back = np.concatenate([upstream(k, length)[2 * r:2 * r + 2] for k in range(n)])
    np.testing.assert_allclose(g, back)

    # Horovod: the allgathered gradient, times the set's size for Sum (with 2 ranks and ones: 2), as is for Average
    g = gradient(mode, lambda t: hvd.reducescatter(t, op=hvd.Average, name=f"g.rs.{mode}"), x)
    np.testing.assert_allclose(g, np.concatenate([upstream(k, 2) for k in range(n)]))
    g = gradient(mode, lambda t: hvd.reducescatter(t, op=hvd.Sum, name=f"g.rss.{mode}"), x)
    np.testing.assert_allclose(g, np.concatenate([upstream(k, 2) for k in range(n)]) * n)


@pytest.mark.mpi(min_size=2)
def test_zero_copy_view_of_eager_tensor():
    from ringtrain.tensorflow import arrays
    x = tf.random.normal([256, 256])
    a, b = arrays.to_array(x), arrays.to_array(x)
    assert np.shares_memory(a, b)         # both are views of the tensor's own buffer, not copies
    out = arrays.aligned_empty((256, 256), np.float32)
    out[...] = 3.0
    t = arrays.to_tensor(out)
    out[0, 0] = 5.0                       # the tensor wraps `out` itself (DLPack), so it sees the write
    assert float(t[0, 0]) == 5.0


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", MODES)
def test_broadcast_into_variables(mode):
    n, r = hvd.size(), hvd.rank()
    root = n - 1
    single = tf.Variable(tf.fill([3], float(r)))
    several = [tf.Variable(tf.fill([k + 1], float(r) * 10)) for k in range(3)] + [tf.Variable(r, dtype=tf.int64)]

    def go():
        hvd.broadcast_(single, root, name=f"bcv.{mode}")
        hvd.broadcast_variables(several, root, prefix=f"bcvs.{mode}")
    run(mode, go)
    np.testing.assert_array_equal(single.numpy(), [root] * 3)
    for k in range(3):
        np.testing.assert_array_equal(several[k].numpy(), [root * 10] * (k + 1))
    assert int(several[3].numpy()) == root
