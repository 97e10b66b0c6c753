"""Where a Keras fit step's communication time goes, for benchmarks/keras_scaling.py's MLP (784-1024-1024-10:
7.4 MB of float32 gradients in 6 tensors). Run it under mpiexec (2 ranks on one node is the case it is made for):

    mpiexec -n 2 python benchmarks/tf_step_costs.py [--rounds 4] [--json out.json]

Part 1, the core alone on numpy arrays of the gradients' shapes, per call (wall on rank 0; CPU = process CPU time of
all threads, mean over ranks): the two paths the binding uses, the shm transport alone on the same bytes (the
floor: pack into the shared window + its allreduce), its pieces, and a 4-byte allreduce (the engine's per-call cost).
Part 2, model.fit at 40 steps per call, per step: plain Keras (the no-communication ceiling); a host call that
returns persistent arrays without touching the gradients (the tf.numpy_function mechanism alone), the same with a
4-byte allreduce (the ranks in lockstep, no gradient traffic), and one that copies the gradients into fresh arrays;
DistributedOptimizer on the copying path (DistributedGradientTape's), on its shared-buffer path (the default: two
buffers per bucket used alternately) and with one buffer per bucket, and the default with the shm barrier's
sched_yield phase stretched from 0.2 ms to 2 ms (watchdog.YIELD_S: what its OS sleeps cost in wall time); and a
split step that takes the allreduce out of the traced step (compiled gradients, eager average on zero-copy views,
compiled apply).
Modes run interleaved in rounds; medians are reported. Numbers vary run to run on a shared machine: compare modes
within one run.
"""
import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # run from a source checkout

import numpy as np  # noqa: E402

SHAPES = [(784, 1024), (1024,), (1024, 1024), (1024,), (1024, 10), (10,)]
BATCH, STEPS, WARMUP = 64, 40, 5


def one_buffer(fn):
    """fn() with one shared buffer per bucket instead of two used alternately (it applies to buckets fn creates)."""
    from ringtrain.tensorflow import shared_buckets
    default, shared_buckets.BUFFERS_PER_BUCKET = shared_buckets.BUFFERS_PER_BUCKET, 1
    try:
        return fn()
    finally:
        shared_buckets.BUFFERS_PER_BUCKET = default


def core_paths(rt, tf_arrays, shared_buckets):
    """name -> a function doing one call; each returns the averaged arrays (or None where it does not average)."""
    from ringtrain.core import state
    from ringtrain.ops import ReduceOp
    rng = np.random.default_rng(rt.rank())
    grads = [tf_arrays.aligned_empty(s, np.float32) for s in SHAPES]
    for g in grads:
        g[...] = rng.normal(size=g.shape)
    total = sum(g.size for g in grads)
    transport = state.engine().transports["cpu"]
    staging = transport.staging_buffer(total * 4).view(np.float32)

    def pack(dst):
        offset = 0
        for g in grads:
            dst[offset:offset + g.size] = g.reshape(-1)
            offset += g.size

    def transport_pack_and_allreduce():
        pack(staging)
        transport.allreduce(staging, ReduceOp.MAX)     # costs what SUM does, and stays finite when repeated

    paths = {
        "grouped allreduce, fresh outputs (tape)": lambda: rt.grouped_allreduce(
            grads, outs=[tf_arrays.aligned_empty(g.shape, g.dtype) for g in grads], name="costs.grouped"),
        "shared buffers in place (optimizer)": lambda: shared_buckets.allreduce_in_shared_buffer(
            grads, "costs.shared", rt.Average, 1.0, 1.0, rt.global_process_set),
        "  one shared buffer per bucket": lambda: one_buffer(
            lambda: shared_buckets.allreduce_in_shared_buffer(grads, "costs.shared2", rt.Average, 1.0, 1.0,
                                                              rt.global_process_set)),
        "shm transport alone: pack + allreduce": transport_pack_and_allreduce,
        "  its pack alone (numpy copy)": lambda: pack(staging),
        "  its allreduce alone": lambda: transport.allreduce(staging, ReduceOp.MAX),
        "4-byte allreduce (engine per call)": lambda: rt.allreduce(np.ones(1, np.float32), name="costs.tiny"),
    }
    everyone = rt.allgather_object([g.copy() for g in grads])
    expected = [np.mean([rank_grads[i] for rank_grads in everyone], axis=0) for i in range(len(grads))]
    return paths, expected


def run_core(rt, tf_arrays, shared_buckets, rounds, calls=40):
    paths, expected = core_paths(rt, tf_arrays, shared_buckets)
    for name, fn in paths.items():
        result = fn()
        if isinstance(result, list):
            for got, want in zip(result, expected):
                if not np.allclose(got, want, rtol=1e-5, atol=1e-6):
                    raise SystemExit(f"rank {rt.rank()}: {name} gave a wrong average")
    table = {name: [] for name in paths}
    for _ in range(rounds):
        for name, fn in paths.items():
            rt.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(calls):
                fn()
            wall, cpu = (time.perf_counter() - wall) / calls, (time.process_time() - cpu) / calls
            table[name].append((1e3 * wall, 1e3 * np.mean(rt.allgather_object(cpu))))
    return table


def run_fit(rt, rounds, only=None):
    import keras
    import tensorflow as tf
    import ringtrain.keras as hvd
    from ringtrain.engine import watchdog
    from ringtrain.tensorflow import arrays as tf_arrays
    from ringtrain.tensorflow import functions, gradients
    host = {"wall": 0.0, "cpu": 0.0, "calls": 0}

    def timed(fn):
        def call(*args):
            wall, cpu = time.perf_counter(), time.thread_time()
            out = fn(*args)
            host["wall"] += time.perf_counter() - wall
            host["cpu"] += time.thread_time() - cpu
            host["calls"] += 1
            return out
        return call

    original_host_call = functions.host_call
    functions.host_call = lambda fn, inputs, specs, name: original_host_call(timed(fn), inputs, specs, name)

    def copy_only(*arrays):
        outs = [tf_arrays.aligned_empty(a.shape, a.dtype) for a in arrays]
        for a, o in zip(arrays, outs):
            np.multiply(a, 0.5, out=o)
        return outs

    class CopyingHostCall(keras.optimizers.SGD):
        def apply(self, grads, trainable_variables=None):
            grads = list(grads)
            outs = tf.numpy_function(timed(copy_only), grads, [g.dtype for g in grads], stateful=True)
            for out, grad in zip(outs, grads):
                out.set_shape(grad.shape)
            return super().apply(outs, trainable_variables)

    persistent = {}

    def no_copy(*arrays):
        # the mechanism alone: TF's inputs arrive as views, persistent aligned outputs are adopted without a copy
        key = tuple(a.shape for a in arrays)
        if key not in persistent:
            persistent[key] = [np.zeros(a.shape, a.dtype) if a.ndim == 0 else tf_arrays.aligned_empty(a.shape, a.dtype)
                               for a in arrays]
            for out in persistent[key]:
                out[...] = 0
        return persistent[key]

    tiny = np.ones(1, np.float32)

    def lockstep(*arrays):
        # the same, plus one 4-byte allreduce: the ranks wait for each other every step, no gradient traffic
        rt.allreduce(tiny, name="costs.lockstep")
        return no_copy(*arrays)

    class NoCopyHostCall(keras.optimizers.SGD):
        host_fn = staticmethod(no_copy)

        def apply(self, grads, trainable_variables=None):
            grads = list(grads)
            outs = tf.numpy_function(timed(self.host_fn), grads, [g.dtype for g in grads], stateful=True)
            for out, grad in zip(outs, grads):
                out.set_shape(grad.shape)
            return super().apply(outs, trainable_variables)

    class Lockstep(NoCopyHostCall):
        host_fn = staticmethod(lockstep)

    def copying_path(optimizer):
        optimizer._ringtrain.reducer.results_in_shared_buffers = False
        return optimizer

    def distributed():
        return hvd.DistributedOptimizer(keras.optimizers.SGD(0.01))

    modes = {
        "plain Keras (ceiling)": lambda: keras.optimizers.SGD(0.01),
        "host call returning persistent arrays, no copy": lambda: NoCopyHostCall(0.01),
        "  the same + a 4-byte allreduce (lockstep)": lambda: Lockstep(0.01),
        "host call copying the gradients, no communication": lambda: CopyingHostCall(0.01),
        "DistributedOptimizer, copying path": lambda: copying_path(distributed()),
        "DistributedOptimizer, shared buffers (default)": distributed,
        "  one shared buffer per bucket, not two": distributed,
        "  the default, shm waits yield 2 ms before sleeping": distributed,
        "split step: compiled grads, eager average, compiled apply": lambda: keras.optimizers.SGD(0.01),
    }
    if only:        # plain Keras stays: the other modes are measured against it
        modes = {name: make for name, make in modes.items()
                 if name.startswith("plain") or any(word in name for word in only)}
    yield_s = {name: (2e-3 if "yield 2 ms" in name else watchdog.YIELD_S) for name in modes}
    rng = np.random.default_rng(1234 + rt.rank())
    x = rng.normal(size=(BATCH * (STEPS + WARMUP), 784)).astype(np.float32)
    y = rng.integers(0, 10, len(x))

    class StepClock(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == 0:
                self.first = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.last = time.perf_counter()

    class SplitStep(keras.Sequential):
        """The allreduce taken out of the traced step: a compiled function returns the gradients, the host averages
        them eagerly (zero-copy views, the optimizer's shared-buffer path), a compiled function applies them."""

        def make_train_function(self, force=False):
            if self.train_function is not None and not force:
                return self.train_function
            model = self

            @tf.function(reduce_retracing=True)
            def gradients_of(data):
                x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
                with tf.GradientTape() as tape:
                    y_pred = model(x, training=True)
                    loss = model._compute_loss(x=x, y=y, y_pred=y_pred, training=True)
                    model._loss_tracker.update_state(loss, sample_weight=tf.shape(x)[0])
                return tape.gradient(loss, model.trainable_weights), model.compute_metrics(x, y, y_pred)

            @tf.function(reduce_retracing=True)
            def apply(grads):
                model.optimizer.apply(grads, model.trainable_weights)

            def train_function(iterator):
                grads, logs = gradients_of(next(iterator))
                apply(gradients.allreduce_gradients(grads, "split", results_in_shared_buffers=True))
                return logs

            self.train_function = train_function
            return train_function

    models = {}
    for name, make in modes.items():
        init = keras.initializers.GlorotUniform
        model = (SplitStep if name.startswith("split") else keras.Sequential)([keras.Input((784,)),
                                  keras.layers.Dense(1024, activation="relu", kernel_initializer=init(seed=1)),
                                  keras.layers.Dense(1024, activation="relu", kernel_initializer=init(seed=2)),
                                  keras.layers.Dense(10, kernel_initializer=init(seed=3))])
        model.compile(optimizer=make(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=False)
        warm_up = lambda: model.fit(x[:WARMUP * BATCH], y[:WARMUP * BATCH], batch_size=BATCH, epochs=1, verbose=0,
                                    shuffle=False)    # noqa: E731 (builds the buckets: one per bucket where named)
        one_buffer(warm_up) if "one shared buffer" in name else warm_up()
        models[name] = model
    table = {name: [] for name in modes}
    default_yield = watchdog.YIELD_S
    for _ in range(rounds):
        for name, model in models.items():
            clock = StepClock()
            host.update(wall=0.0, cpu=0.0, calls=0)
            watchdog.YIELD_S = yield_s[name]
            rt.barrier()
            cpu = time.process_time()
            model.fit(x[WARMUP * BATCH:], y[WARMUP * BATCH:], batch_size=BATCH, epochs=1, verbose=0, shuffle=False,
                      callbacks=[clock])
            cpu = (time.process_time() - cpu) / STEPS
            watchdog.YIELD_S = default_yield
            step = max(rt.allgather_object(clock.last - clock.first)) / STEPS
            calls = max(1, host["calls"])
            means = np.mean(rt.allgather_object([cpu, host["wall"] / calls, host["cpu"] / calls]), axis=0)
            table[name].append([1e3 * step] + [1e3 * v for v in means])
    weights = {name: float(np.abs(np.concatenate([v.numpy().ravel() for v in m.trainable_variables])).sum())
               for name, m in models.items()}
    in_sync = {name: len(set(rt.allgather_object(w))) == 1 for name, w in weights.items()}
    return table, in_sync


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json")
    parser.add_argument("--inter-op", type=int, default=0, help="TF inter-op threads per rank (default: TF's)")
    parser.add_argument("--fit-only", metavar="WORD", nargs="+",
                        help="skip part 1 and run only the fit modes whose names contain one of these words")
    args = parser.parse_args()
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)      # as keras_scaling at 2 ranks on 2 cores
    if args.inter_op:
        tf.config.threading.set_inter_op_parallelism_threads(args.inter_op)
    import ringtrain as rt
    import ringtrain.keras as hvd
    from ringtrain.tensorflow import arrays as tf_arrays
    from ringtrain.tensorflow import shared_buckets
    hvd.init()
    load_start = os.getloadavg()
    core = {} if args.fit_only else run_core(rt, tf_arrays, shared_buckets, args.rounds)
    fit, in_sync = run_fit(rt, args.rounds, args.fit_only)
    load_end = os.getloadavg()
    if rt.rank() == 0:
        print(f"# {rt.size()} ranks, transport {rt.transport_name()}, {os.cpu_count()} cores, TF inter-op threads "
              f"{tf.config.threading.get_inter_op_parallelism_threads() or 'default'}; load average at start "
              f"{load_start}, at end {load_end}; {args.rounds} interleaved rounds, medians (per-round values)")
        print("\n## 1. The core alone, 7.45 MB float32 in 6 arrays, ms per call: wall (rank 0) / CPU (all threads)")
        for name, rows in core.items():
            wall, cpu = np.median([w for w, _ in rows]), np.median([c for _, c in rows])
            print(f"{name:44s} {wall:6.2f} / {cpu:5.2f}    ({'  '.join(f'{w:.2f}/{c:.2f}' for w, c in rows)})")
        print("\n## 2. model.fit, 40 steps per call, batch 64 per rank, ms per step (means over ranks): step wall / "
              "process CPU / host call wall / host call CPU (its thread); ceiling = median over rounds of the plain "
              "step / this mode's step in the same round")
        plain = [row[0] for row in next(iter(fit.values()))]
        for name, rows in fit.items():
            med = np.median(np.array(rows), axis=0)
            ceiling = np.median([p / row[0] for p, row in zip(plain, rows)])
            no_averaging = name.startswith(("plain", "host")) or "lockstep" in name
            print(f"{name:58s} {med[0]:5.1f} / {med[1]:5.1f} / {med[2]:4.2f} / {med[3]:4.2f}   {100 * ceiling:3.0f}%"
                  f"    weights {'in sync' if in_sync[name] or no_averaging else 'DIFFER'}"
                  f"    ({'  '.join('/'.join(f'{v:.1f}' for v in r) for r in rows)})")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": rt.size(), "load_average_start": load_start, "load_average_end": load_end,
                           "core_ms_wall_cpu": core, "fit_ms_step_cpu_hostwall_hostcpu": fit,
                           "in_sync": in_sync}, f, indent=1)
    hvd.shutdown()


if __name__ == "__main__":
    main()
