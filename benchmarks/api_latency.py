"""What each public form of an allreduce costs, beside MPI_Allreduce in the same job.

    mpiexec -n 2 python benchmarks/api_latency.py [--quick] [--rounds 5] [--tf] [--jax] [--json out.json]

Every form reduces float32 data of 4 KB, 64 KB, 1 MB and 16 MB (the scalar form: one float32). The forms run
interleaved, round after round (a round times every form once at every size), and each figure is the median over
rounds of the slowest rank's mean time per call. `#wrong` counts results that differ from the numpy reference. Ratios
are to MPI_Allreduce (mpi4py, numpy buffers) of the same size in the same round: on a shared machine only ratios
taken in one job mean anything.

Forms (torch unless named):
  in_place      hvd.allreduce_(t, name=...)
  out_of_place  hvd.allreduce(t, name=...)
  out_of_place_unstreamed  the same with the shm transport's non-temporal result writes off (from 4 MB up it writes
                the result as an in-place call would); only when --forms names it: a same-run A/B of those writes
  unnamed       hvd.allreduce(t)
  async_wait    hvd.synchronize(hvd.allreduce_async(t, name=...))
  async_wait_   hvd.synchronize(hvd.allreduce_async_(t, name=...))
  grouped       hvd.grouped_allreduce([t[:n/2], t[n/2:]], name=...)
  scalar        hvd.allreduce(torch.tensor(0.5), name=...)   (one size: 4 bytes)
  numpy         ringtrain.allreduce(a, name=...)             (the core API, out of place)
  tf_eager      ringtrain.tensorflow.allreduce(t, name=...)  (--tf)
  tf_noop_op    tf.identity(t): TensorFlow's own floor for one eager op (no collective)
  tf_convert    the eager call's conversions alone: a view of t, an aligned copy, adopted back (no collective)
  jax_eager     ringtrain.jax.allreduce(a, name=...)         (--jax)
  jax_callback  jax.pure_callback(identity, a): JAX's own floor for a host call (no collective)
  jax_convert   the eager call's conversions alone: np.asarray(a), a numpy copy, a new jax.Array of it (no collective)
  jax_in        np.asarray(a) alone: the eager call's way in (a read-only view of the jax.Array's buffer)
  jax_out       a new jax.Array of a numpy result (a copy XLA makes), dropped: the eager call's way out for results
                below 256 KB and the freeing of its result (larger results are adopted from the core's pool: not
                timed here)
With numpy (the core call the eager call makes), jax_in + numpy + jax_out is the JAX eager call's floor phase by
phase; what jax_eager takes beyond that sum is the binding's own Python.
A JAX form's timed call returns the jax.Array (the check reads it with np.asarray afterwards, untimed), as the torch
forms return tensors.
--pairs N: then, at each size, N pairs of one in-place and one out-of-place call (the two arms interleaved call by
call, the order alternating ABBA), each call timed alone (the slowest rank's time); the table gives the median of
the per-pair ratios out of place / in place with its quartiles: a steadier reading of what the out-of-place result
costs than two separately timed blocks of calls, which drift with the machine between them.

The floors' x_mpi says how far a form could get if ringtrain's own part took no time at all. x_conv_mpi (tf_eager and
jax_eager): the ratio to that framework's conversions alone plus MPI_Allreduce, in the same round -- the reference
for a TF or JAX caller, whose tensors must become host arrays and back whatever library reduces them.
"""
import argparse
import os
import resource
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np                                     # noqa: E402
from mpi4py import MPI                                 # noqa: E402

from common import format_table, human_bytes, machine_info, median, pair_summary, write_json   # noqa: E402

SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20)
CALLS = {4 << 10: 300, 64 << 10: 150, 1 << 20: 30, 16 << 20: 6}
QUICK_CALLS = {4 << 10: 100, 64 << 10: 40, 1 << 20: 8, 16 << 20: 2}
OPT_IN = {"out_of_place_unstreamed"}     # forms that run only when --forms names them
SMALL_ONLY = {"jax_out": 256 << 10}      # forms timed only below this size
CONVERSIONS = {"tf_eager": "tf_convert", "jax_eager": "jax_convert"}    # x_conv_mpi's reference, with MPI's time


def make_forms(args):
    """form -> (setup(nbytes) -> state, call(state) -> result, expected(nbytes) -> array)."""
    import torch
    import ringtrain.torch as hvd
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()

    def data(n, dtype=np.float32):
        return (np.arange(n) % 13 + rank).astype(dtype)

    def want(n):
        return sum((np.arange(n) % 13 + r).astype(np.float64) for r in range(size)) / size

    forms = {}

    def tensor_form(name, call):
        def setup(nbytes):
            n = nbytes // 4
            return {"t": torch.from_numpy(data(n)), "n": n, "name": f"bench.{name}.{nbytes}"}
        # in-place forms reduce their own result again in the timed calls: the Average of equal values, so the
        # value stays (the first call, which is the one checked, starts from each rank's own input)
        forms[name] = (setup, call, lambda nbytes: want(nbytes // 4))

    tensor_form("in_place", lambda s: hvd.allreduce_(s["t"], name=s["name"]))
    tensor_form("out_of_place", lambda s: hvd.allreduce(s["t"], name=s["name"]))
    tensor_form("unnamed", lambda s: hvd.allreduce(s["t"]))
    tensor_form("out_of_place_unstreamed", lambda s: _unstreamed(hvd.allreduce, s["t"], s["name"]))
    tensor_form("async_wait", lambda s: hvd.synchronize(hvd.allreduce_async(s["t"], name=s["name"])))
    tensor_form("async_wait_", lambda s: hvd.synchronize(hvd.allreduce_async_(s["t"], name=s["name"])))

    def grouped(s):      # the results (a list) are concatenated for the check only, outside the timed calls
        t, half = s["t"], s["n"] // 2
        return hvd.grouped_allreduce([t[:half], t[half:]], name=s["name"])
    tensor_form("grouped", grouped)

    forms["scalar"] = (lambda nbytes: {"t": torch.tensor(0.5 + rank)},
                       lambda s: hvd.allreduce(s["t"], name="bench.scalar"),
                       lambda nbytes: np.array(0.5 + (size - 1) / 2))

    import ringtrain as rt
    forms["numpy"] = (lambda nbytes: {"a": data(nbytes // 4), "name": f"bench.numpy.{nbytes}"},
                      lambda s: rt.allreduce(s["a"], name=s["name"]), lambda nbytes: want(nbytes // 4))
    if args.tf:
        import tensorflow as tf
        import ringtrain.tensorflow as hvd_tf
        from ringtrain.tensorflow import arrays as tf_arrays
        # one thread per op pool, as torch.set_num_threads(1) above: ranks share the cores
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
        forms["tf_eager"] = (lambda nbytes: {"t": tf.constant(data(nbytes // 4)), "name": f"bench.tf.{nbytes}"},
                             lambda s: hvd_tf.allreduce(s["t"], name=s["name"]).numpy(),
                             lambda nbytes: want(nbytes // 4))
        # TF's own floor: one no-op eager op; and the conversions the eager call makes (view in, aligned buffer
        # adopted out) with no collective between them
        forms["tf_noop_op"] = (lambda nbytes: {"t": tf.constant(data(nbytes // 4))},
                               lambda s: tf.identity(s["t"]).numpy(), lambda nbytes: data(nbytes // 4))
        forms["tf_convert"] = (lambda nbytes: {"t": tf.constant(data(nbytes // 4))},
                               lambda s: _tf_round_trip(tf_arrays, s["t"]).numpy(), lambda nbytes: data(nbytes // 4))
    if args.jax:
        import jax
        import jax.numpy as jnp
        import ringtrain.jax as hvd_jax
        from ringtrain.jax import arrays as jax_arrays
        forms["jax_eager"] = (lambda nbytes: {"a": jnp.asarray(data(nbytes // 4)), "name": f"bench.jax.{nbytes}"},
                              lambda s: hvd_jax.allreduce(s["a"], name=s["name"]),
                              lambda nbytes: want(nbytes // 4))
        # JAX's own floor: an eager jax.pure_callback of the identity; and the conversions the eager call makes
        forms["jax_callback"] = (lambda nbytes: {"a": jnp.asarray(data(nbytes // 4))},
                                 lambda s: jax.pure_callback(_identity, s["a"], s["a"]),
                                 lambda nbytes: data(nbytes // 4))
        forms["jax_convert"] = (lambda nbytes: {"a": jnp.asarray(data(nbytes // 4))},
                                lambda s: _jax_round_trip(jax_arrays, s["a"]),
                                lambda nbytes: data(nbytes // 4))
        forms["jax_in"] = (lambda nbytes: {"a": jnp.asarray(data(nbytes // 4))}, lambda s: np.asarray(s["a"]),
                           lambda nbytes: data(nbytes // 4))
        forms["jax_out"] = (lambda nbytes: {"r": np.zeros(nbytes // 4, np.float32)},
                            lambda s: jax_arrays.copy_to_jax(s["r"]), lambda nbytes: np.zeros(nbytes // 4))

    comm = MPI.COMM_WORLD

    def mpi_setup(nbytes):
        return {"a": data(nbytes // 4), "out": np.empty(nbytes // 4, np.float32)}

    def mpi_call(s):
        comm.Allreduce(s["a"], s["out"], op=MPI.SUM)
        s["out"] /= size          # Average, as the forms above
        return s["out"]
    forms["MPI_Allreduce"] = (mpi_setup, mpi_call, lambda nbytes: want(nbytes // 4))
    return forms


def run_pairs(forms, nbytes, pairs, comm):
    """--pairs: `pairs` pairs of one in-place and one out-of-place call of nbytes, interleaved ABBA, each call timed
    alone; the slowest rank's time of each call, as (in-place times, out-of-place times) in us."""
    arms = [forms["in_place"], forms["out_of_place"]]
    states = [setup(nbytes) for setup, _, _ in arms]
    kept = None
    for (_, call, _), s in zip(arms, states):     # warm-up: plans, pools
        kept = call(s)
        kept = call(s)
    times = np.zeros((2, pairs))
    clock = time.perf_counter
    comm.Barrier()
    for i in range(pairs):
        for arm in ((0, 1) if i % 4 in (0, 3) else (1, 0)):
            call, s = arms[arm][1], states[arm]
            t0 = clock()
            result = call(s)
            times[arm, i] = clock() - t0
            if arm == 1:
                kept = result          # a caller's variable: the previous result lives until this call returns
    del kept
    slowest = np.empty_like(times)
    comm.Allreduce(times, slowest, op=MPI.MAX)
    return slowest[0] * 1e6, slowest[1] * 1e6


def _unstreamed(allreduce, t, name):
    """allreduce(t, name=name) with the shm transport's non-temporal result writes off (ringtrain/stream_copy.py)."""
    from ringtrain import stream_copy
    threshold, stream_copy.STREAM_BYTES = stream_copy.STREAM_BYTES, 1 << 62
    try:
        return allreduce(t, name=name)
    finally:
        stream_copy.STREAM_BYTES = threshold


def _identity(x):
    return x


def _tf_round_trip(arrays, tensor):
    """What the eager call does around the core call (functions.allreduce's fast path), with a copy for the
    collective."""
    view = arrays.host_view(tensor)
    out = arrays.result_empty(view.shape, view.dtype)
    out[...] = view
    return arrays.adopt(out)


def _jax_round_trip(arrays, a):
    """What the eager call does around the core call (allreduce.allreduce's fast path), with a copy for the
    collective."""
    view = np.asarray(a)
    out = np.empty(view.shape, view.dtype) if view.nbytes < arrays.COPIED_BYTES else arrays.aligned_empty(
        view.shape, view.dtype)
    out[...] = view
    return arrays.copy_to_jax(out) if out.nbytes < arrays.COPIED_BYTES else arrays.to_jax(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="fewer calls and 2 rounds (a smoke test)")
    parser.add_argument("--sizes", default=None, help="comma-separated byte counts (default 4K,64K,1M,16M)")
    parser.add_argument("--forms", default=None, help="comma-separated subset of forms")
    parser.add_argument("--tf", action="store_true", help="include TensorFlow eager")
    parser.add_argument("--jax", action="store_true", help="include JAX eager")
    parser.add_argument("--pairs", type=int, default=0, help="then N interleaved in-place/out-of-place pairs per "
                                                                 "size (per-pair ratios)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--out", default=None, help="write the table here too, between lines giving the command, "
                                                    "the start and end times, the load and the commit")
    args = parser.parse_args()
    rounds = 2 if args.quick else args.rounds
    calls = QUICK_CALLS if args.quick else CALLS
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else list(SIZES)

    started = (time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), os.getloadavg())
    import ringtrain.torch as hvd
    hvd.init()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    forms = make_forms(args)
    keep = set(args.forms.split(",")) if args.forms else set(forms) - OPT_IN
    forms = {k: v for k, v in forms.items() if k in keep | {"MPI_Allreduce"}}

    times = {}             # (form, nbytes) -> [us per call, one per round]
    wrong = {}
    faults = {}            # (form, nbytes) -> [page faults per call (minor, the most of any rank), one per round]
    for rnd in range(rounds):
        for nbytes in sizes:
            n_calls = calls.get(nbytes, max(2, int(3e8 // max(nbytes, 1) // 100)))
            for form, (setup, call, expected) in forms.items():
                if (form == "scalar" and nbytes != sizes[0]) or nbytes >= SMALL_ONLY.get(form, nbytes + 1):
                    continue
                s = setup(nbytes)
                result = call(s)          # warm-up: first sightings, caches, pools
                call(s)
                if isinstance(result, list):          # a grouped form's results, in order
                    result = np.concatenate([np.asarray(r).reshape(-1) for r in result])
                bad = int(not np.allclose(np.asarray(result, np.float64), expected(nbytes), rtol=1e-5))
                comm.Barrier()
                faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                t0 = time.perf_counter()
                for _ in range(n_calls):
                    call(s)
                elapsed = (time.perf_counter() - t0) / n_calls
                faulted = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0) / n_calls
                slowest = comm.allreduce(elapsed, op=MPI.MAX)
                key = (form, 4 if form == "scalar" else nbytes)
                faults.setdefault(key, []).append(comm.allreduce(faulted, op=MPI.MAX))
                times.setdefault(key, []).append(slowest * 1e6)
                wrong[key] = wrong.get(key, 0) + comm.allreduce(bad, op=MPI.SUM)
    pair_times = {nbytes: run_pairs(forms, nbytes, args.pairs, comm) for nbytes in sizes
                  if args.pairs and "in_place" in forms and "out_of_place" in forms}
    if rank == 0:
        mpi = {nbytes: times[("MPI_Allreduce", nbytes)] for nbytes in sizes}
        records, rows = [], []
        for (form, nbytes), values in times.items():
            base_bytes = sizes[0] if form == "scalar" else nbytes
            ratios = [v / m for v, m in zip(values, mpi[base_bytes])]
            in_place = times.get(("in_place", nbytes))
            conversion = times.get((CONVERSIONS.get(form), nbytes))
            record = {"form": form, "ranks": size, "bytes": nbytes, "dtype": "float32", "op": "average",
                      "time_us": median(values), "rounds_us": values, "x_mpi": median(ratios),
                      "x_in_place": median([v / i for v, i in zip(values, in_place)]) if in_place else None,
                      "x_conv_mpi": (median([v / (c + m) for v, c, m in zip(values, conversion, mpi[base_bytes])])
                                     if conversion else None),
                      "faults_per_call": median(faults[(form, nbytes)]), "wrong": wrong[(form, nbytes)]}
            records.append(record)
        records.sort(key=lambda r: (r["bytes"] if r["form"] != "scalar" else sizes[0], list(forms).index(r["form"])))
        for r in records:
            rows.append([human_bytes(r["bytes"]), r["form"], f"{r['time_us']:.1f}",
                         f"{min(r['rounds_us']):.1f}", f"{max(r['rounds_us']):.1f}", f"{r['x_mpi']:.2f}",
                         "-" if r["x_in_place"] is None else f"{r['x_in_place']:.2f}",
                         "-" if r["x_conv_mpi"] is None else f"{r['x_conv_mpi']:.2f}",
                         f"{r['faults_per_call']:.0f}", r["wrong"]])
        title = (f"allreduce per call, {size} ranks, float32 Average, median of {rounds} interleaved rounds "
                 f"(slowest rank's mean per round); x_mpi: ratio to MPI_Allreduce of that size in the same round "
                 f"(scalar: to MPI at {human_bytes(sizes[0])}); x_in_place: ratio to the in-place form of that size in the same "
                 f"round; x_conv_mpi: ratio to the framework's conversions alone plus MPI_Allreduce in the same round; "
                 f"faults: minor page faults per call (median over rounds of the most of any rank)")
        text = format_table(["size", "form", "time_us", "min_us", "max_us", "x_mpi", "x_in_place", "x_conv_mpi",
                             "faults", "#wrong"], rows, title=title)
        pair_records = []
        for nbytes, (in_place, out_of_place) in pair_times.items():
            ratio, low, high = pair_summary(in_place, out_of_place)
            pair_records.append({"bytes": nbytes, "pairs": len(in_place), "in_place_us": median(list(in_place)),
                                 "out_of_place_us": median(list(out_of_place)), "x_in_place": ratio,
                                 "x_in_place_quartiles": [low, high]})
        if pair_records:
            text += "\n" + format_table(
                ["size", "pairs", "in_place_us", "out_of_place_us", "x_in_place", "quartiles"],
                [[human_bytes(r["bytes"]), r["pairs"], f"{r['in_place_us']:.1f}", f"{r['out_of_place_us']:.1f}",
                  f"{r['x_in_place']:.3f}", "%.3f-%.3f" % tuple(r["x_in_place_quartiles"])] for r in pair_records],
                title=f"out of place against in place, call by call: {args.pairs} pairs per size, the arms "
                      f"interleaved ABBA, each call the slowest rank's time; x_in_place: median of the per-pair "
                      f"ratios (quartiles beside)")
        load = os.getloadavg()
        text += f"\n# load average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
        print(text, flush=True)
        if args.out:
            command = " ".join(["mpiexec", "-n", str(size), "python", "benchmarks/api_latency.py"] + sys.argv[1:])
            with open(args.out, "w") as f:
                f.write(f"# {started[0]} UTC start, commit {machine_info()['commit']}, load before "
                        f"{started[1][0]:.2f} {started[1][1]:.2f} {started[1][2]:.2f}\n# {command}\n{text}\n"
                        f"# {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC end\n")
        if args.json:
            write_json(args.json, {"machine": machine_info(), "ranks": size, "rounds": rounds,
                                   "loadavg_end": load, "records": records, "pairs": pair_records})
    hvd.shutdown()


if __name__ == "__main__":
    main()
