"""Keras 3 training throughput at 1..N ranks: ringtrain.keras inside model.fit against the no-communication ceiling
and against TensorFlow's own tf.distribute.MultiWorkerMirroredStrategy, in one run.

    python benchmarks/keras_scaling.py --max-ranks 2 --json out.json [--quick]

The script launches itself under `mpiexec -n N` (do not start it under mpiexec yourself). Every N runs an MLP on a
synthetic per-rank batch in these modes:
  fit/no-comm        plain Keras model.fit, no communication: the ceiling (N independent processes)
  fit/ringtrain      model.fit with ringtrain.keras.DistributedOptimizer (bucketed grouped allreduce per step)
  loop/no-comm       a tf.function training step (GradientTape, SGD), no communication
  loop/ringtrain     the same step with ringtrain.tensorflow.DistributedGradientTape
  loop/mwms          the same step under tf.distribute.MultiWorkerMirroredStrategy (gRPC + ring collectives)
  fit/mwms           model.fit under MultiWorkerMirroredStrategy: attempted, and its error recorded. With Keras 3
                     (TF >= 2.16) fit under MWMS fails with "Attempt to convert a value (PerReplica ...)"
                     (keras-team/keras#20585, tensorflow/tensorflow#72388), so MWMS is measured in the custom loop.
The ringtrain and no-comm modes share one job per N, interleaved in rounds (the median round is reported); MWMS must be
configured before TensorFlow starts, so it runs in a job of its own. Scaling efficiency = T(N) / (N * T(1)), T the
total samples/s and T(1) the single-process no-comm throughput of the same style (fit or loop); "vs no-comm" is T(N)
over the no-comm mode of the same style and N, same job. A fit mode's T counts its steps (first batch begin to last
batch end, see step_clock); the whole fit() call per step is reported beside it (call_ms/step), and the process
CPU time per step (cpu_ms/step, nearly blind to other jobs' load). Correctness: every
distributed mode must end with identical weights on all ranks, and loop/ringtrain must match loop/mwms (same seed,
same data, same averaged gradients) to float tolerance.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import common
from train_scaling import mpiexec_path   # sibling benchmark: the same mpiexec lookup

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)
sys.path.append(REPO_ROOT)   # run from a source checkout without pip install

RINGTRAIN_MODES = ("fit/no-comm", "fit/ringtrain", "loop/no-comm", "loop/ringtrain")
MWMS_MODES = ("loop/mwms", "fit/mwms")
PARAM_TOLERANCE = 1e-4       # loop/ringtrain vs loop/mwms: same math, different summation order


# ---------------------------------------------------------------- worker (one MPI rank)

def configure_mwms(comm):
    """TF_CONFIG for MultiWorkerMirroredStrategy: rank 0 picks free localhost ports, every rank learns them."""
    ports = None
    if comm.Get_rank() == 0:
        sockets = [socket.socket() for _ in range(comm.Get_size())]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        ports = [s.getsockname()[1] for s in sockets]
        for s in sockets:
            s.close()
    ports = comm.bcast(ports)
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                                          "task": {"type": "worker", "index": comm.Get_rank()}})


def run_worker(args):
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    mwms = args.job == "mwms"
    if mwms:
        configure_mwms(comm)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    strategy = None
    if mwms:
        options = tf.distribute.experimental.CommunicationOptions(
            implementation=tf.distribute.experimental.CommunicationImplementation.RING)
        strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    else:
        import ringtrain.keras as hvd
        hvd.init()

    rng = np.random.default_rng(1234 + comm.Get_rank())
    rows = args.batch * (args.steps + args.warmup)
    x = rng.normal(size=(rows, args.inputs)).astype(np.float32)
    y = rng.integers(0, 10, rows)
    modes = MWMS_MODES if mwms else RINGTRAIN_MODES
    rounds, errors, final = {}, {}, {}
    for round_index in range(args.rounds):
        for mode in modes:
            if mode in errors:
                continue
            try:
                measured, weights = train_mode(mode, args, comm, strategy, x, y)
            except Exception as error:
                if mode != "fit/mwms":
                    raise
                # the known Keras 3 failure (see the docstring) is this mode's result, on every rank alike
                errors[mode] = {"mode": mode, "ranks": comm.Get_size(), "error": f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"}
                continue
            rounds.setdefault(mode, []).append(measured)
            if round_index == 0:
                final[mode] = weights
    results = dict(errors, **{mode: median_round(measured, args.batch) for mode, measured in rounds.items()})
    if comm.Get_rank() == 0:
        for mode, weights in final.items():
            np.save(os.path.join(os.path.dirname(args.worker_json),
                                 f"weights-{comm.Get_size()}-{mode.replace('/', '_')}.npy"), weights)
        common.write_json(args.worker_json, {"ranks": comm.Get_size(), "job": args.job, "modes": results,
                                             "threads_per_rank": args.threads, "batch_per_rank": args.batch,
                                             "parameters": parameter_count(args)})
    if not mwms:
        hvd.shutdown()


def median_round(rounds, batch):
    """A mode's rounds as one record: the median throughput; weights in sync only if they were every round."""
    rates = [r["samples_per_s_per_rank"] for r in rounds]
    rate = common.median(rates)
    cpu = [r["cpu_ms_per_step"] for r in rounds]
    whole = [r["whole_call_step_ms"] for r in rounds]
    return dict(rounds[0], samples_per_s_per_rank=rate, samples_per_s_total=rate * rounds[0]["ranks"],
                step_ms=1e3 * batch / rate, rounds=rates, cpu_ms_per_step=common.median(cpu), cpu_rounds=cpu,
                whole_call_step_ms=common.median(whole), whole_call_rounds=whole,
                params_in_sync=all(r["params_in_sync"] for r in rounds))


def parameter_count(args):
    return args.inputs * args.hidden + args.hidden + args.hidden * args.hidden + args.hidden + args.hidden * 10 + 10


def build_model(args):
    import keras
    init = keras.initializers.GlorotUniform
    return keras.Sequential([keras.Input((args.inputs,)),
                             keras.layers.Dense(args.hidden, activation="relu", kernel_initializer=init(seed=1)),
                             keras.layers.Dense(args.hidden, activation="relu", kernel_initializer=init(seed=2)),
                             keras.layers.Dense(10, kernel_initializer=init(seed=3))])


def train_mode(mode, args, comm, strategy, x, y):
    import keras
    import numpy as np
    import tensorflow as tf
    from mpi4py import MPI
    style, kind = mode.split("/")
    scope = strategy.scope() if kind == "mwms" else _null_scope()
    with scope:
        model = build_model(args)
        optimizer = keras.optimizers.SGD(0.01)
        if kind == "ringtrain" and style == "fit":
            import ringtrain.keras as hvd
            optimizer = hvd.DistributedOptimizer(optimizer)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    warm_x, warm_y = x[:args.warmup * args.batch], y[:args.warmup * args.batch]
    run_x, run_y = x[args.warmup * args.batch:], y[args.warmup * args.batch:]

    clock = step_clock()
    if style == "fit":
        model.compile(optimizer=optimizer, loss=loss_fn, jit_compile=False)

        def run(xs, ys):
            model.fit(xs, ys, batch_size=args.batch, epochs=1, shuffle=False, verbose=0, callbacks=[clock])
    else:
        step = make_loop_step(kind, model, optimizer, strategy, comm.Get_size() * args.batch)

        def run(xs, ys):
            loss = None
            for i in range(len(ys) // args.batch):
                rows = slice(i * args.batch, (i + 1) * args.batch)
                loss = step(tf.constant(xs[rows]), tf.constant(ys[rows]))
            float(strategy.reduce("MEAN", loss, axis=None) if kind == "mwms" else loss)   # wait for the last step

    run(warm_x, warm_y)
    comm.Barrier()
    start, cpu_start = time.perf_counter(), time.process_time()
    run(run_x, run_y)
    elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)   # the job runs at its slowest rank's pace
    whole_call = elapsed
    if style == "fit":      # the steps themselves: first batch begin to last batch end (see step_clock)
        elapsed = comm.allreduce(clock.last_end - clock.first_begin, op=MPI.MAX)
    # CPU time of the whole process (all its threads) per step, mean over ranks: what a mode costs in compute,
    # nearly blind to other jobs' load (wall time on a shared 2-core machine is not)
    cpu_s = comm.allreduce(time.process_time() - cpu_start) / comm.Get_size()
    weights = np.concatenate([w.numpy().reshape(-1) for w in model.trainable_variables])
    checksums = comm.allgather(float(np.abs(weights).sum()))
    ranks = comm.Get_size()
    return {"mode": mode, "ranks": ranks, "step_ms": 1e3 * elapsed / args.steps,
            "whole_call_step_ms": 1e3 * whole_call / args.steps,
            "cpu_ms_per_step": 1e3 * cpu_s / args.steps,
            "samples_per_s_per_rank": args.batch * args.steps / elapsed,
            "samples_per_s_total": ranks * args.batch * args.steps / elapsed,
            "params_in_sync": kind == "no-comm" or ranks == 1 or len(set(checksums)) == 1}, weights


def step_clock():
    """A callback timing a fit call's steps: from its first batch's begin to its last batch's end. A whole fit()
    call also holds per-call work -- building the data iterator, and after the last step a stall of ~0.5 s that
    some calls show and others do not (seen with and without ringtrain: the main thread waits on a lock while the
    call is torn down) -- which training pays once per epoch, not per step; `whole_call_step_ms` keeps it."""
    import keras

    class StepClock(keras.callbacks.Callback):
        first_begin = last_end = None

        def on_train_batch_begin(self, batch, logs=None):
            if batch == 0:
                self.first_begin = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.last_end = time.perf_counter()
    return StepClock()


class _null_scope:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def make_loop_step(kind, model, optimizer, strategy, global_batch):
    import keras
    import tensorflow as tf
    per_example = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            # mean over the global batch: MWMS sums replicas' gradients, ringtrain averages per-rank means
            loss = (tf.nn.compute_average_loss(per_example(yb, model(xb)), global_batch_size=global_batch)
                    if kind == "mwms" else tf.reduce_mean(per_example(yb, model(xb))))
        if kind == "ringtrain":
            import ringtrain.tensorflow as hvd_tf
            tape = hvd_tf.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    if kind == "mwms":
        return tf.function(lambda xb, yb: strategy.run(replica_step, args=(xb, yb)))
    return tf.function(replica_step)


# ---------------------------------------------------------------- driver (no MPI here: it launches the jobs)

def launch(ranks, job, args, folder):
    worker_json = os.path.join(folder, f"{job}-ranks{ranks}.json")
    command = [mpiexec_path(), "-n", str(ranks), sys.executable, os.path.abspath(__file__), "--worker",
               "--job", job, "--worker-json", worker_json, "--threads", str(args.threads), "--batch",
               str(args.batch), "--inputs", str(args.inputs), "--hidden", str(args.hidden), "--steps",
               str(args.steps), "--warmup", str(args.warmup), "--rounds", str(args.rounds)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    started = time.perf_counter()
    completed = subprocess.run(command, env=env, timeout=args.job_timeout, capture_output=True, text=True)
    if completed.returncode != 0:
        raise SystemExit(f"the {ranks}-rank {job} job failed (exit {completed.returncode}):\n"
                         f"{completed.stdout[-4000:]}\n{completed.stderr[-4000:]}")
    payload = common.read_json(worker_json)
    payload["wall_s"] = time.perf_counter() - started
    return payload


def summarise(jobs, folder):
    import numpy as np
    base = {}
    for job in jobs:
        if job["ranks"] == 1:
            for mode, r in job["modes"].items():
                if mode.endswith("/no-comm") and "error" not in r:
                    base[mode.split("/")[0]] = r["samples_per_s_total"]
    records = []
    for job in jobs:
        for mode, r in job["modes"].items():
            record = dict(r, threads_per_rank=job["threads_per_rank"], batch_per_rank=job["batch_per_rank"],
                          parameters=job["parameters"])
            if "error" not in r:
                own = base.get(mode.split("/")[0])
                record["efficiency"] = r["samples_per_s_total"] / (job["ranks"] * own) if own else None
            records.append(record)
    ceilings = {(r["ranks"], r["mode"].split("/")[0]): r["samples_per_s_total"] for r in records
                if r["mode"].endswith("/no-comm") and "error" not in r}
    for record in records:
        ceiling = ceilings.get((record["ranks"], record["mode"].split("/")[0]))
        if "error" not in record and ceiling:
            record["vs_no_comm_same_ranks"] = record["samples_per_s_total"] / ceiling
    for ranks in sorted({j["ranks"] for j in jobs}):
        paths = [os.path.join(folder, f"weights-{ranks}-loop_{kind}.npy") for kind in ("ringtrain", "mwms")]
        if all(os.path.exists(p) for p in paths):
            diff = float(np.max(np.abs(np.load(paths[0]) - np.load(paths[1]))))
            for record in records:
                if record["ranks"] == ranks and record["mode"] in ("loop/ringtrain", "loop/mwms"):
                    record["max_weight_diff_ringtrain_vs_mwms"] = diff
    return records


def print_report(records, load_at_start):
    rows = []
    for r in sorted(records, key=lambda r: (r["ranks"], r["mode"])):
        if "error" in r:
            rows.append([r["ranks"], r["mode"], "-", "-", "-", "-", "-", "-", "-", f"FAILS: {r['error'][:90]}"])
            continue
        check = "in sync" if r["params_in_sync"] else "RANKS DIFFER"
        if "max_weight_diff_ringtrain_vs_mwms" in r:
            check += f", |dw| ringtrain vs mwms {r['max_weight_diff_ringtrain_vs_mwms']:.1e}"
        efficiency = r.get("efficiency")
        versus = r.get("vs_no_comm_same_ranks")
        rows.append([r["ranks"], r["mode"], f"{r['step_ms']:.1f}", f"{r['whole_call_step_ms']:.1f}",
                     f"{r['cpu_ms_per_step']:.1f}",
                     f"{r['samples_per_s_per_rank']:.0f}",
                     f"{r['samples_per_s_total']:.0f}", "-" if efficiency is None else f"{100 * efficiency:.0f}%",
                     "-" if versus is None else f"{100 * versus:.0f}%", check])
    first = next(r for r in records if "parameters" in r)
    print(common.format_table(
        ["ranks", "mode", "step_ms", "call_ms/step", "cpu_ms/step", "samples/s/rank", "samples/s", "efficiency",
         "vs no-comm", "check"], rows,
        title=f"Keras 3 scaling: {first['parameters'] / 1e6:.2f} M-parameter MLP, batch {first['batch_per_rank']} "
              f"per rank, {first['threads_per_rank']} thread(s) per rank, {os.cpu_count()} cores; efficiency = "
              f"T(N)/(N*T(1)), T(1) = no-comm of the same style on 1 rank; vs no-comm = T(N) over the no-comm "
              f"mode of the same style and N, same job; step_ms: fit = first batch begin to last batch end, "
              f"loop = the loop; call_ms/step = the whole fit() call (or loop) over its steps; cpu_ms/step = "
              f"process CPU time of the call per step, mean over ranks; "
              f"load average (1/5/15 min) at start {load_at_start}"))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-ranks", type=int, default=2)
    parser.add_argument("--json")
    parser.add_argument("--quick", action="store_true",
                        help="small model, few steps (about a minute); MWMS only at more than one rank")
    parser.add_argument("--no-mwms", action="store_true", help="skip the MultiWorkerMirroredStrategy jobs")
    parser.add_argument("--threads", type=int, default=None, help="TF intra-op threads per rank "
                                                                  "(default cores // max-ranks)")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--inputs", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None, help="repetitions of every mode; median is reported")
    parser.add_argument("--job-timeout", type=float, default=None, help="seconds per mpiexec job")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--job", choices=("ringtrain", "mwms"), help=argparse.SUPPRESS)
    parser.add_argument("--worker-json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quick = args.quick
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // args.max_ranks)
    args.batch = args.batch or (16 if quick else 64)
    args.inputs = args.inputs or (64 if quick else 784)
    args.hidden = args.hidden or (64 if quick else 1024)
    args.steps = args.steps or (5 if quick else 40)
    args.warmup = args.warmup or (2 if quick else 5)
    args.rounds = args.rounds or (1 if quick else 3)
    args.job_timeout = args.job_timeout or (300 if quick else 900)
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        run_worker(args)
        return 0
    if any(os.environ.get(v) for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")):
        raise SystemExit("run keras_scaling.py without mpiexec: it launches one mpiexec job per rank count")
    jobs = []
    load_at_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as folder:
        for ranks in range(1, args.max_ranks + 1):
            # --quick checks MultiWorkerMirroredStrategy only where it communicates (a 1-rank MWMS job is one more
            # TensorFlow start for a figure the check does not use)
            mwms = not args.no_mwms and not (args.quick and ranks == 1)
            for job in ("ringtrain",) + (("mwms",) if mwms else ()):
                jobs.append(launch(ranks, job, args, folder))
                print(f"# {ranks} rank(s), {job} job: done in {jobs[-1]['wall_s']:.1f} s", flush=True)
        records = summarise(jobs, folder)
    print_report(records, load_at_start)
    print(f"# load average (1/5/15 min) at end {os.getloadavg()}")
    if args.json:
        common.write_json(args.json, {"machine": common.machine_info(), "load_average_at_end": os.getloadavg(),
                                      "load_average_at_start": load_at_start, "records": records})
    bad = [r for r in records if "error" not in r and (not r["params_in_sync"] or
                                                        r.get("max_weight_diff_ringtrain_vs_mwms", 0) > PARAM_TOLERANCE)]
    for r in bad:
        print(f"# WRONG: {r['ranks']} ranks {r['mode']}: weights in sync {r['params_in_sync']}, "
              f"max |dw| ringtrain vs mwms {r.get('max_weight_diff_ringtrain_vs_mwms')}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
