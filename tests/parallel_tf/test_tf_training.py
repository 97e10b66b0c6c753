"""N ranks training == one process training on the concatenated batch (10 steps, float64, to 1e-5), through
DistributedGradientTape (SGD + momentum) and Keras fit (Adam), eager and tf.function, backward_passes_per_step 1
and 2; plus the callbacks, the model check and the XLA policy."""
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import ringtrain.keras as hvd
import ringtrain.tensorflow as hvd_tf
from ringtrain.errors import RingtrainError, TensorMismatchError

STEPS, BATCH_PER_RANK, FEATURES, CLASSES = 10, 4, 6, 3
ATOL = 1e-5


def make_model(seed=0, hidden=8):
    """The same weights on every rank for the same seed (initializers are seeded, not the global RNG)."""
    model = keras.Sequential([
        keras.Input((FEATURES,), dtype="float64"),
        keras.layers.Dense(hidden, activation="sigmoid", dtype="float64",
                           kernel_initializer=keras.initializers.GlorotUniform(seed=seed)),
        keras.layers.Dense(CLASSES, dtype="float64", kernel_initializer=keras.initializers.GlorotUniform(seed=seed + 1),
                           bias_initializer=keras.initializers.RandomNormal(seed=seed + 2)),
    ])
    return model


def global_data(steps=STEPS):
    rng = np.random.default_rng(1234)
    n = hvd.size()
    x = rng.normal(size=(steps * n * BATCH_PER_RANK, FEATURES))
    y = rng.integers(0, CLASSES, size=len(x))
    return x, y


def shard(array, steps=STEPS):
    """This rank's rows of every global batch: global batch s = rows [s*n*B, (s+1)*n*B), rank r takes its r-th B."""
    n, r, b = hvd.size(), hvd.rank(), BATCH_PER_RANK
    return np.concatenate([array[(s * n + r) * b:(s * n + r + 1) * b] for s in range(steps)])


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def reference_weights(make_optimizer, passes_per_step=1, average_aggregated=False):
    """One process, the whole global batch per step; with k passes per step, the sum of k batches' gradients (their
    mean with average_aggregated)."""
    x, y = global_data()
    model = make_model()
    optimizer = make_optimizer()
    global_batch = hvd.size() * BATCH_PER_RANK
    for update in range(STEPS // passes_per_step):
        total = None
        for k in range(passes_per_step):
            s = update * passes_per_step + k
            with tf.GradientTape() as tape:
                loss = LOSS(y[s * global_batch:(s + 1) * global_batch], model(x[s * global_batch:(s + 1) * global_batch]))
            grads = tape.gradient(loss, model.trainable_variables)
            total = grads if total is None else [a + g for a, g in zip(total, grads)]
        if average_aggregated:
            total = [t / passes_per_step for t in total]
        optimizer.apply_gradients(zip(total, model.trainable_variables))
    return [w.numpy() for w in model.trainable_variables]


def assert_same_everywhere_and_equal(weights, reference):
    everyone = hvd.allgather_object([w.tolist() for w in weights])
    for other in everyone:
        for a, b in zip(other, everyone[0]):
            np.testing.assert_array_equal(a, b)         # bit-identical across ranks
    for got, expected in zip(weights, reference):
        np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)


def sgd_momentum():
    return keras.optimizers.SGD(learning_rate=0.5, momentum=0.9)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_gradient_tape_sgd_momentum_equals_one_process(mode):
    x, y = global_data()
    xs, ys = shard(x), shard(y)
    model, optimizer = make_model(), sgd_momentum()

    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = LOSS(yb, model(xb))
        tape = hvd_tf.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    step = tf.function(step) if mode == "graph" else step
    b = BATCH_PER_RANK
    for s in range(STEPS):
        step(tf.constant(xs[s * b:(s + 1) * b]), tf.constant(ys[s * b:(s + 1) * b]))
    assert_same_everywhere_and_equal([w.numpy() for w in model.trainable_variables], reference_weights(sgd_momentum))


def adam():
    return keras.optimizers.Adam(learning_rate=0.05)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_keras_fit_adam_equals_one_process(mode, passes):
    x, y = global_data()
    model = make_model()
    model.compile(optimizer=hvd.DistributedOptimizer(adam(), backward_passes_per_step=passes), loss=LOSS,
                  run_eagerly=(mode == "eager"), jit_compile=False)
    model.fit(shard(x), shard(y), batch_size=BATCH_PER_RANK, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == STEPS // passes      # applied updates only
    assert_same_everywhere_and_equal([w.numpy() for w in model.trainable_variables],
                                     reference_weights(adam, passes_per_step=passes))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_keras_fit_sgd_equals_one_process(mode, passes):
    x, y = global_data()
    model = make_model()
    model.compile(optimizer=hvd.DistributedOptimizer(sgd_momentum(), backward_passes_per_step=passes), loss=LOSS,
                  run_eagerly=(mode == "eager"), jit_compile=False)
    model.fit(shard(x), shard(y), batch_size=BATCH_PER_RANK, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == STEPS // passes
    assert_same_everywhere_and_equal([w.numpy() for w in model.trainable_variables],
                                     reference_weights(sgd_momentum, passes_per_step=passes))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("options", ["average_aggregated_gradients", "predivide", "both"])
def test_keras_fit_average_aggregated_gradients_and_predivide_equal_one_process(options):
    """average_aggregated_gradients=True applies the mean of the k accumulated gradients (not their sum);
    gradient_predivide_factor=size divides before the sum and multiplies after: the same average."""
    passes = 2 if options != "predivide" else 1
    kwargs = {}
    if options != "predivide":
        kwargs["average_aggregated_gradients"] = True
    if options != "average_aggregated_gradients":
        kwargs["gradient_predivide_factor"] = float(hvd.size())
    x, y = global_data()
    model = make_model()
    model.compile(optimizer=hvd.DistributedOptimizer(sgd_momentum(), backward_passes_per_step=passes, **kwargs),
                  loss=LOSS, jit_compile=False)
    model.fit(shard(x), shard(y), batch_size=BATCH_PER_RANK, epochs=1, shuffle=False, verbose=0)
    assert_same_everywhere_and_equal([w.numpy() for w in model.trainable_variables],
                                     reference_weights(sgd_momentum, passes_per_step=passes,
                                                       average_aggregated=passes > 1))


@pytest.mark.mpi(min_size=2)
def test_keras_names_its_buckets_per_process_set():
    """As torch's: an optimizer that only a set's members create is numbered within that set, so the world's next
    optimizer has the same name on every rank."""
    members = hvd.add_process_set([0])
    try:
        if hvd.rank() == 0:
            inside = hvd.DistributedOptimizer(sgd_momentum(), process_set=members)
            assert f".set{members.process_set_id}." in inside._ringtrain.prefix
        world = hvd.DistributedOptimizer(sgd_momentum())
        names = hvd.allgather_object(world._ringtrain.prefix, name="check.keras.prefix")
        assert names == [names[0]] * hvd.size() and ".set" not in names[0]
    finally:
        hvd.remove_process_set(members)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("passes", [1, 2])
def test_keras_fit_several_steps_per_execution_equals_one_process(passes):
    """steps_per_execution=5: five train steps in one traced loop, so the next steps' host calls reuse the shared
    buffers whose views an earlier step's update read -- the update must have consumed them by then."""
    x, y = global_data()
    model = make_model()
    model.compile(optimizer=hvd.DistributedOptimizer(adam(), backward_passes_per_step=passes), loss=LOSS,
                  steps_per_execution=5, jit_compile=False)
    model.fit(shard(x), shard(y), batch_size=BATCH_PER_RANK, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == STEPS // passes
    assert_same_everywhere_and_equal([w.numpy() for w in model.trainable_variables],
                                     reference_weights(adam, passes_per_step=passes))


@pytest.mark.mpi(min_size=2)
def test_broadcast_callback_equalizes_divergent_weights():
    root = hvd.size() - 1
    model = make_model(seed=100 * hvd.rank())             # different initial weights on every rank
    model.compile(optimizer=hvd.DistributedOptimizer(adam()), loss=LOSS, jit_compile=False)
    before = hvd.allgather_object([w.numpy().tolist() for w in model.weights])
    assert before[0][0] != before[1][0]
    callback = hvd.callbacks.BroadcastGlobalVariablesCallback(root)
    callback.set_model(model)
    callback.on_train_begin()
    after = hvd.allgather_object([w.numpy().tolist() for w in model.weights])
    for weights in after:
        for got, expected in zip(weights, before[root]):
            np.testing.assert_array_equal(got, expected)


class RecordLogs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epochs = []

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(dict(logs))


@pytest.mark.mpi(min_size=2)
def test_metric_average_callback_gives_the_mean_of_the_ranks():
    x, y = global_data()
    model = make_model()
    model.compile(optimizer=hvd.DistributedOptimizer(adam()), loss=LOSS, metrics=["accuracy"], jit_compile=False)
    raw, averaged = RecordLogs(), RecordLogs()
    rank_data = shard(x) * (1 + hvd.rank())              # ranks see different data: different local metrics
    model.fit(rank_data, shard(y), batch_size=BATCH_PER_RANK, epochs=2, shuffle=False, verbose=0,
              callbacks=[raw, hvd.callbacks.MetricAverageCallback(), averaged])
    everyone = hvd.allgather_object(raw.epochs)
    assert everyone[0][0]["loss"] != everyone[1][0]["loss"]
    for epoch, logs in enumerate(averaged.epochs):
        for key in ("loss", "accuracy"):
            expected = np.mean([per_rank[epoch][key] for per_rank in everyone])
            assert logs[key] == pytest.approx(expected, rel=1e-12), key


@pytest.mark.mpi(min_size=2)
def test_callbacks_on_a_process_set_work_within_it():
    """Two disjoint sets, {0} and {1, ..., n-1}, run both callbacks at once under the same names: each set's weights
    become its own root's, each set's metrics its own mean. A rank outside a set gets the error at construction."""
    n, r = hvd.size(), hvd.rank()
    sets = [hvd.add_process_set([0]), hvd.add_process_set(list(range(1, n)))]
    try:
        mine, other = (sets[0], sets[1]) if r == 0 else (sets[1], sets[0])
        members = [0] if r == 0 else list(range(1, n))
        root = members[-1]                                   # a world rank, as Horovod's root_rank
        with pytest.raises(ValueError, match=f"rank {r} is not a member of process set {other.process_set_id}"):
            hvd.callbacks.MetricAverageCallback(process_set=other)
        with pytest.raises(ValueError, match="is not a member of process set"):
            hvd.callbacks.BroadcastGlobalVariablesCallback(root, process_set=other)

        model = make_model(seed=100 * r)                     # different initial weights on every rank
        model.compile(optimizer=hvd.DistributedOptimizer(adam(), process_set=mine), loss=LOSS, jit_compile=False)
        before = hvd.allgather_object([w.numpy().tolist() for w in model.weights])
        broadcast = hvd.callbacks.BroadcastGlobalVariablesCallback(root, process_set=mine)
        broadcast.set_model(model)
        broadcast.on_train_begin()
        for got, expected in zip(model.weights, before[root]):
            np.testing.assert_array_equal(got.numpy(), expected)

        average = hvd.callbacks.MetricAverageCallback(process_set=mine)
        average.set_model(model)
        logs = {"loss": float(r + 1) ** 2, "accuracy": 0.25 * r}
        average.on_epoch_end(0, logs)
        assert logs["loss"] == pytest.approx(np.mean([(m + 1.0) ** 2 for m in members]), rel=1e-12)
        assert logs["accuracy"] == pytest.approx(np.mean([0.25 * m for m in members]), rel=1e-12, abs=1e-15)
    finally:
        for process_set in sets:
            hvd.remove_process_set(process_set)


@pytest.mark.mpi(min_size=2)
def test_model_differing_across_ranks_names_the_variable_and_ranks():
    n = hvd.size()
    odd = n - 1
    model = make_model(hidden=9 if hvd.rank() == odd else 8)
    optimizer = hvd.DistributedOptimizer(adam())
    with pytest.raises(TensorMismatchError) as error:
        optimizer.build(model.trainable_variables)
    message = str(error.value)
    assert "variable 'sequential/dense/kernel (#0)'" in message
    assert f"ranks {list(range(n - 1))} have shape (6, 8)" in message
    assert f"ranks [{odd}] have shape (6, 9)" in message


@pytest.mark.mpi(min_size=2)
def test_xla_is_turned_off_with_a_warning_and_training_still_averages():
    x, y = global_data()
    model = make_model()
    model.compile(optimizer=hvd.DistributedOptimizer(adam()), loss=LOSS, jit_compile=True)
    assert model.jit_compile
    with pytest.warns(UserWarning, match="runs without XLA"):
        model.fit(shard(x), shard(y), batch_size=BATCH_PER_RANK, epochs=1, shuffle=False, verbose=0,
                  callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    assert model.jit_compile is False
    assert_same_everywhere_and_equal([w.numpy() for w in model.trainable_variables], reference_weights(adam))


@pytest.mark.mpi(min_size=2)
def test_xla_without_a_ringtrain_callback_fails_with_the_fix():
    x, y = global_data()
    model = make_model()
    model.compile(optimizer=hvd.DistributedOptimizer(adam()), loss=LOSS, jit_compile=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RingtrainError, match="jit_compile=False"):
            model.fit(shard(x), shard(y), batch_size=BATCH_PER_RANK, epochs=1, verbose=0)


@pytest.mark.mpi(min_size=2)
def test_collectives_inside_jit_compile_fail_at_trace_time_and_work_outside():
    """tf.function(jit_compile=True) compiles for XLA_CPU_JIT here as it would for a GPU, and XLA cannot run a host
    callback: a collective or a DistributedGradientTape traced inside it raises RingtrainError naming it and the
    fix, on every rank, before anything is sent (not TensorFlow's 'unsupported operations: PyFunc' at run time).
    The fix it names works: gradients from a jit-compiled function, averaged outside it."""
    n, r = hvd.size(), hvd.rank()
    weights = tf.Variable([1.0, 2.0])

    def gradients(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(weights * x)
        return tape, loss

    @tf.function(jit_compile=True)
    def allreduce_in_xla(x):
        return hvd_tf.allreduce(x, name="xla.allreduce")

    @tf.function(jit_compile=True)
    def tape_in_xla(x):
        tape, loss = gradients(x)
        return hvd_tf.DistributedGradientTape(tape).gradient(loss, [weights])

    x = tf.constant([1.0, float(r)])
    for fn, what in ((allreduce_in_xla, "'xla.allreduce'"), (tape_in_xla, "'DistributedGradientTape")):
        with pytest.raises(RingtrainError, match=f"ringtrain collective {what}.* inside an XLA cluster") as error:
            fn(x)
        assert "outside the jit-compiled function" in str(error.value)

    @tf.function(jit_compile=True)
    def gradients_in_xla(x):
        tape, loss = gradients(x)
        return tape.gradient(loss, [weights])

    @tf.function
    def averaged_outside(x):
        return hvd_tf.grouped_allreduce(gradients_in_xla(x), name="xla.outside")

    (averaged,) = averaged_outside(x)
    np.testing.assert_allclose(averaged.numpy(), [1.0, (n - 1) / 2])


@pytest.mark.mpi(min_size=2)
def test_learning_rate_warmup_and_schedule():
    n = hvd.size()
    model = make_model()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=LOSS)
    warmup = hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.8, warmup_epochs=2, steps_per_epoch=4)
    warmup.set_model(model)
    warmup.on_epoch_begin(0)
    assert float(model.optimizer.learning_rate) == pytest.approx(0.8 / n)            # starts at lr / size
    warmup.on_train_batch_begin(2)                                                   # epoch 0.5 of 2
    assert float(model.optimizer.learning_rate) == pytest.approx(0.8 / n * (0.5 * (n - 1) / 2 + 1))
    schedule = hvd.callbacks.LearningRateScheduleCallback(0.8, lambda epoch: 0.1 ** epoch, start_epoch=1)
    schedule.set_model(model)
    schedule.on_epoch_begin(2)
    assert float(model.optimizer.learning_rate) == pytest.approx(0.8 * 0.01)


@pytest.mark.mpi(min_size=2)
def test_only_rank_zero_writes_and_prints(capsys):
    marker = object()
    assert hvd.rank_zero_only(marker) == ([marker] if hvd.rank() == 0 else [])
    assert hvd.verbose(2) == (2 if hvd.rank() == 0 else 0)
    hvd.print0("hello from rank zero")
    assert ("hello from rank zero" in capsys.readouterr().out) == (hvd.rank() == 0)
