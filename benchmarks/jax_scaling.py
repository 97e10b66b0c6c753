"""JAX training throughput at 1..N ranks: ringtrain.jax's DistributedOptimizer against mpi4jax's allreduce in the
same training loop, against JAX's own multi-process CPU collectives, and against the no-communication ceiling.

    python benchmarks/jax_scaling.py --max-ranks 2 --runs 3 --json out.json [--quick]

The script launches itself under `mpiexec -n N` (do not start it under mpiexec yourself). Every N trains the same
MLP (optax SGD with momentum) on a synthetic per-rank batch, one jitted step per iteration, in these modes:
  no-comm      optax alone, no communication: the ceiling (N independent processes)
  ringtrain    hvd.DistributedOptimizer (defaults): all gradient leaves in one XLA FFI custom call whose input
               and output buffers the reducer reads and writes in place, ordered by its data (no JAX effect)
  ringtrain-ordered   DistributedOptimizer(ordered=True): the same call also carrying JAX's ordering token, as
               every ringtrain.jax collective and every mpi4jax call does (JAX's slower dispatch path)
  ringtrain-callback  the defaults through JAX's Python host callback (RINGTRAIN_JAX_LOWERING=callback, the
               fallback where the FFI handler cannot be built)
  mpi4jax      mpi4jax.allreduce(g, op=MPI.SUM) / N on every gradient leaf, then optax (mpi4jax's own way: one
               MPI_Allreduce per array, each an XLA FFI custom call without Python)
  jax-gloo     jax.distributed + a shard_map'd psum over one CPU device per process (gloo collectives), then optax
The first five share one job per N, interleaved in short rounds whose mode order alternates (forward in even
rounds, backward in odd ones: ABBA, so a drift in load falls on every mode alike); jax.distributed must be set up
before JAX starts, so jax-gloo runs in a job of its own. --runs K repeats the shared jobs K times (separate mpiexec
jobs, one after the other). steps/s is per rank (ranks step in lockstep), the median over every round of every
run; "vs mpi4jax" is the median over rounds of the round's ratio (the mode's steps/s over mpi4jax's in the same
round, a few hundred milliseconds apart), "ratio IQR" its 25th-75th percentiles and "per run" each run's median
ratio (jax-gloo, from another job: the ratio of the medians); efficiency = steps/s(N) / steps/s(1 rank, no-comm).
Correctness: each distributed mode must end with the same parameters on every rank, and ringtrain, mpi4jax and
jax-gloo must agree with each other (same data, same averaged gradients) to float tolerance: "#wrong" counts
parameters that do not.
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

SHARED_MODES = ("no-comm", "ringtrain", "ringtrain-ordered", "ringtrain-callback", "mpi4jax")
LOWERINGS = {"ringtrain": "ffi", "ringtrain-ordered": "ffi", "ringtrain-callback": "callback"}   # per mode
PARAM_TOLERANCE = 1e-4


# ---------------------------------------------------------------- worker (one MPI rank)

def model_and_data(args, rank):
    import jax
    import jax.numpy as jnp
    import numpy as np
    sizes = [args.features] + [args.hidden] * args.layers + [10]
    keys = jax.random.split(jax.random.PRNGKey(0), len(sizes) - 1)
    params = [{"w": jax.random.normal(k, (a, b), jnp.float32) / np.sqrt(a), "b": jnp.zeros(b, jnp.float32)}
              for k, a, b in zip(keys, sizes, sizes[1:])]
    rng = np.random.default_rng(1 + rank)
    x = rng.standard_normal((args.batch_size, args.features)).astype(np.float32)
    y = rng.integers(0, 10, args.batch_size)

    def loss(params, x, y):
        import optax
        h = x
        for layer in params[:-1]:
            h = jax.nn.relu(h @ layer["w"] + layer["b"])
        return optax.softmax_cross_entropy_with_integer_labels(h @ params[-1]["w"] + params[-1]["b"], y).mean()
    return params, jnp.asarray(x), jnp.asarray(y), loss


def make_step(loss, tx, average=None):
    import jax
    import optax

    @jax.jit
    def step(params, opt_state, x, y):
        grads = jax.grad(loss)(params, x, y)
        if average is not None:
            grads = average(grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state
    return step


def time_steps(step, state, x, y, count):
    import jax
    params, opt_state = state
    jax.block_until_ready(params)
    start = time.perf_counter()
    for _ in range(count):
        params, opt_state = step(params, opt_state, x, y)
    jax.block_until_ready(params)
    return time.perf_counter() - start, (params, opt_state)


def flat(params):
    import jax
    import numpy as np
    return np.concatenate([np.asarray(p).ravel() for p in jax.tree_util.tree_leaves(params)])


def run_shared_job(args, comm):
    import jax
    import optax
    from mpi4py import MPI
    import mpi4jax
    import ringtrain
    import ringtrain.jax as hvd
    hvd.init()
    rank, size = comm.Get_rank(), comm.Get_size()
    params, x, y, loss = model_and_data(args, rank)
    inner = optax.sgd(0.01, momentum=0.9)
    txs = {"no-comm": inner, "ringtrain": hvd.DistributedOptimizer(inner),
           "ringtrain-ordered": hvd.DistributedOptimizer(inner, ordered=True),
           "ringtrain-callback": hvd.DistributedOptimizer(inner), "mpi4jax": inner}
    averages = {"mpi4jax": lambda grads: jax.tree_util.tree_map(
        lambda g: mpi4jax.allreduce(g, op=MPI.SUM, comm=comm) / size, grads)}
    steps = {mode: make_step(loss, txs[mode], averages.get(mode)) for mode in SHARED_MODES}
    states = {mode: (params, txs[mode].init(params)) for mode in SHARED_MODES}
    for mode in SHARED_MODES:                                 # compile and warm up
        # the lowering is chosen when a step is compiled (its first call): set it per mode, for this job only
        ringtrain.config().jax_lowering = LOWERINGS.get(mode, "auto")
        _, states[mode] = time_steps(steps[mode], states[mode], x, y, args.warmup)
    ringtrain.config().jax_lowering = "auto"
    times = {mode: [] for mode in SHARED_MODES}
    for number in range(args.rounds):
        for mode in round_order(SHARED_MODES, number):
            comm.Barrier()
            elapsed, states[mode] = time_steps(steps[mode], states[mode], x, y, args.steps)
            times[mode].append(comm.allreduce(elapsed, op=MPI.MAX))
    finals = {mode: flat(states[mode][0]) for mode in SHARED_MODES}
    hvd.shutdown()
    return times, finals


def round_order(modes, number):
    """The modes of round `number`: forward in even rounds, backward in odd ones (ABBA against drifting load)."""
    return tuple(modes) if number % 2 == 0 else tuple(reversed(modes))


def round_ratios(times, peer_times):
    """Per round: the mode's steps/s over the peer's in the same round (= the peer's time over the mode's)."""
    return [peer / mine for mine, peer in zip(times, peer_times)]


def quartiles(values):
    """(25th percentile, median, 75th percentile), linear interpolation between the sorted values."""
    ordered = sorted(values)

    def at(q):
        position = q * (len(ordered) - 1)
        low = int(position)
        high = min(low + 1, len(ordered) - 1)
        return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
    return at(0.25), at(0.5), at(0.75)


def run_gloo_job(args, comm):
    import numpy as np
    port = None
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port)
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=comm.Get_size(),
                               process_id=comm.Get_rank())
    import optax
    from jax import shard_map
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from mpi4py import MPI
    size = comm.Get_size()
    mesh = Mesh(np.array(jax.devices()), ("ranks",))
    params, x, y, loss = model_and_data(args, comm.Get_rank())
    tx = optax.sgd(0.01, momentum=0.9)
    replicated = NamedSharding(mesh, PartitionSpec())
    by_rank = NamedSharding(mesh, PartitionSpec("ranks"))

    def local_step(params, opt_state, x, y):
        grads = jax.tree_util.tree_map(lambda g: jax.lax.psum(g, "ranks") / size, jax.grad(loss)(params, x, y))
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    step = jax.jit(shard_map(local_step, mesh=mesh, in_specs=(PartitionSpec(), PartitionSpec(),
                                                                PartitionSpec("ranks"), PartitionSpec("ranks")),
                             out_specs=(PartitionSpec(), PartitionSpec()), check_vma=False))

    def global_array(local, sharding):
        return jax.make_array_from_process_local_data(sharding, np.asarray(local))
    state = (jax.tree_util.tree_map(lambda p: global_array(p, replicated), params), None)
    state = (state[0], jax.tree_util.tree_map(lambda s: global_array(s, replicated), tx.init(params)))
    gx, gy = global_array(x, by_rank), global_array(y, by_rank)
    time_steps(step, state, gx, gy, 0)
    _, state = time_steps(step, state, gx, gy, args.warmup)
    times = []
    for _ in range(args.rounds):
        comm.Barrier()
        elapsed, state = time_steps(step, state, gx, gy, args.steps)
        times.append(comm.allreduce(elapsed, op=MPI.MAX))
    local = jax.tree_util.tree_map(lambda p: np.asarray(p.addressable_data(0)), state[0])
    return {"jax-gloo": times}, {"jax-gloo": flat(local)}


def run_worker(args):
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    try:
        times, finals = (run_gloo_job if args.job == "gloo" else run_shared_job)(args, comm)
        error = None
    except Exception as e:                      # a peer that cannot run here is reported, not fatal
        times, finals, error = {}, {}, f"{type(e).__name__}: {e}"
    everyone = comm.gather({mode: v.tolist() for mode, v in finals.items()}, root=0)
    if comm.Get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"times": times, "finals": everyone, "error": error}, f)


# ---------------------------------------------------------------- driver

def launch(ranks, args, job, folder, run=0):
    out = os.path.join(folder, f"{job}_{ranks}_{run}.json")
    command = [mpiexec_path(), "-n", str(ranks), sys.executable, os.path.abspath(__file__), "--worker", "--job", job,
               "--out", out, "--steps", str(args.steps), "--rounds", str(args.rounds), "--warmup",
               str(args.warmup), "--batch-size", str(args.batch_size), "--features", str(args.features),
               "--hidden", str(args.hidden), "--layers", str(args.layers)]
    env = dict(os.environ, OMP_NUM_THREADS="1", XLA_FLAGS="--xla_cpu_multi_thread_eigen=false "
               "intra_op_parallelism_threads=1", PYTHONPATH=os.pathsep.join(filter(None, [REPO_ROOT,
                                                                                          os.environ.get("PYTHONPATH")])))
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0 or not os.path.exists(out):
        return {"times": {}, "finals": [], "error": f"job exited {done.returncode}: {done.stderr[-1500:]}"}
    with open(out) as f:
        return json.load(f)


def count_wrong(finals, reference):
    """Parameters differing between ranks of one distributed mode, or from the reference mode's rank 0 (no-comm
    ranks train on different data: not checked)."""
    import numpy as np
    wrong = {}
    for mode in [m for m in (finals[0] if finals else []) if m != "no-comm"]:
        mine = [np.asarray(rank[mode]) for rank in finals]
        bad = sum(int(np.sum(~np.isclose(m, mine[0], rtol=PARAM_TOLERANCE, atol=PARAM_TOLERANCE))) for m in mine[1:])
        if reference is not None:
            bad += int(np.sum(~np.isclose(mine[0], reference, rtol=PARAM_TOLERANCE, atol=PARAM_TOLERANCE)))
        wrong[mode] = bad
    return wrong


def records_for(ranks, runs, steps, wrong):
    """One record per mode: steps/s of every round of every run (in round order, runs one after the other), and
    the per-round ratios against mpi4jax's round of the same job."""
    records = {}
    for run, result in enumerate(runs):
        peer = result["times"].get("mpi4jax")
        for mode, times in result["times"].items():
            record = records.setdefault(mode, {"ranks": ranks, "mode": mode, "rounds": [], "ratios": [],
                                               "run_ratios": [], "wrong": 0})
            record["rounds"] += [steps / t for t in times]
            if peer is not None and len(peer) == len(times):
                ratios = round_ratios(times, peer)
                record["ratios"] += ratios
                record["run_ratios"].append(common.median(ratios))
            record["wrong"] = max(record["wrong"], wrong[run].get(mode, 0))
    for record in records.values():
        record["steps_per_s"] = common.median(record["rounds"])
    return list(records.values())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="steps per mode per round")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--runs", type=int, default=1, help="shared jobs per rank count, one after the other")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="rows per rank per step")
    parser.add_argument("--features", type=int, default=784)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=3, help="hidden layers")
    parser.add_argument("--no-gloo", action="store_true", help="skip the jax.distributed (gloo) job")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per mpiexec job")
    parser.add_argument("--quick", action="store_true", help="tiny model and few steps: checks the script runs")
    parser.add_argument("--json", help="write the records here (and a .txt table beside it)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--job", default="shared", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return run_worker(args)
    if args.quick:
        args.steps, args.rounds, args.warmup, args.features, args.hidden, args.layers = 3, 2, 1, 16, 32, 2
    records, errors = [], {}
    args.load = [round(x, 2) for x in os.getloadavg()]      # 1/5/15-minute load averages at the start and end
    with tempfile.TemporaryDirectory() as folder:
        for ranks in range(1, args.max_ranks + 1):
            shared = [launch(ranks, args, "shared", folder, run) for run in range(args.runs)]
            gloo = [launch(ranks, args, "gloo", folder)] if ranks > 1 and not args.no_gloo else []
            for run, result in enumerate(shared):
                if result["error"]:
                    errors[f"shared job {run + 1}, {ranks} ranks"] = result["error"]
            for result in gloo:
                if result["error"]:
                    errors[f"gloo job, {ranks} ranks"] = result["error"]
            wrong = []
            for result in shared:                 # every run checked against mpi4jax's parameters of that run
                finals = result["finals"] or []
                if gloo and gloo[0]["finals"] and finals:
                    finals = [dict(a, **b) for a, b in zip(finals, gloo[0]["finals"])]
                reference = finals[0].get("mpi4jax") if finals else None
                wrong.append(count_wrong(finals, reference) if ranks > 1 else {})
            gloo_wrong = [{"jax-gloo": max((w.get("jax-gloo", 0) for w in wrong), default=0)} for _ in gloo]
            records += records_for(ranks, shared + gloo, args.steps, wrong + gloo_wrong)
    args.load += [round(x, 2) for x in os.getloadavg()]
    print_table(records, args, errors)
    if args.json:
        payload = {"machine": common.machine_info(), "settings": vars(args), "records": records, "errors": errors}
        common.write_json(args.json, payload)
        with open(os.path.splitext(args.json)[0] + ".txt", "w") as f:
            print_table(records, args, errors, file=f)
    if any(r["wrong"] for r in records):
        raise SystemExit("parameters differ between ranks or modes: see #wrong")


def print_table(records, args, errors, file=None):
    base = {r["ranks"]: r["steps_per_s"] for r in records if r["mode"] == "no-comm"}
    peer = {r["ranks"]: r["steps_per_s"] for r in records if r["mode"] == "mpi4jax"}
    rows = []
    for r in records:
        if r["ratios"]:
            low, ratio, high = quartiles(r["ratios"])
            ratio, spread = f"{ratio:.2f}", f"{low:.2f}-{high:.2f}"
            per_run = " ".join(f"{x:.2f}" for x in r["run_ratios"])
        else:                                  # another job (jax-gloo): the ratio of the medians
            ratio = f"{r['steps_per_s'] / peer[r['ranks']]:.2f}" if peer.get(r["ranks"]) else "-"
            spread = per_run = "-"
        rows.append([r["ranks"], r["mode"], f"{r['steps_per_s']:.1f}",
                     f"{r['steps_per_s'] * r['ranks'] * args.batch_size:.0f}",
                     f"{r['steps_per_s'] / base[1]:.2f}" if 1 in base else "-", ratio, spread, per_run, r["wrong"]])
    params = args.features * args.hidden + args.hidden * args.hidden * (args.layers - 1) + args.hidden * 10
    title = (f"JAX MLP {args.features}-{'-'.join([str(args.hidden)] * args.layers)}-10 (~{params / 1e6:.2f} M "
             f"parameters, {2 * (args.layers + 1)} arrays), batch {args.batch_size} per rank, optax SGD momentum; "
             f"{args.runs} run(s) x {args.rounds} rounds x {args.steps} steps, modes in ABBA order; "
             f"{common.machine_info()['date']}, commit {common.source_commit()[:12]}, load average {args.load[0]} "
             f"at the start, {args.load[3]} at the end")
    print(common.format_table(["ranks", "mode", "steps/s", "samples/s", "efficiency", "vs mpi4jax", "ratio IQR",
                               "per run", "#wrong"], rows, title), file=file)
    for where, error in errors.items():
        print(f"# {where}: {error.splitlines()[-1] if error.splitlines() else error}", file=file)


if __name__ == "__main__":
    main()
