"""Training throughput at 1..N ranks and scaling efficiency, ringtrain against torch DDP and Horovod, in one run.

    python benchmarks/train_scaling.py --max-ranks 2 --json out.json --png out.png [--quick]

The script launches itself under `mpiexec -n N` for N = 1..max-ranks (do not start it under mpiexec yourself).
Synthetic models, each on the same per-rank batch (--models; the first two by default):
  convnet  a VGG-like convnet on 32x32 RGB: ~6.7 M parameters in 10 tensors (few large gradients)
  mlp      100 blocks of Linear + LayerNorm: ~0.3 M parameters in 402 tensors (hundreds of small gradients, as
           real models have: ResNet-50 161 tensors, BERT ~400), so per-tensor costs dominate
  resnet18 ResNet-18 (torchvision's layout, batch norm) on 32x32 RGB: 11.2 M parameters in 62 tensors
Every N runs every model in these modes, interleaved in rounds so that machine noise hits all of them alike; the
median over rounds is reported:
  no-comm               plain torch, no communication: the ceiling (N independent processes)
  lockstep              plain torch plus one MPI barrier per step after backward, no gradient traffic: the
                        synchronous ceiling. Every synchronous method (DDP, Horovod, ringtrain) makes each step wait
                        for the slowest rank and runs the ranks' phases at the same moments; this mode pays exactly
                        that and nothing else, so no-comm -> lockstep is what synchronising costs on this machine and
                        lockstep -> a method is what the method itself costs (its allreduce, hooks, copies, waits).
  ringtrain-after-backward  ringtrain.torch.DistributedOptimizer(overlap=False): step() reduces every bucket on
                        the caller's thread after backward
  ringtrain-overlap     ringtrain.torch.DistributedOptimizer(overlap=True): buckets allreduced from hooks during
                        backward (by the engine's thread)
                        The optimizer's default (overlap=None) picks one by hardware; the record of the mode it
                        picks here says "default": true.
  torch-ddp             torch.nn.parallel.DistributedDataParallel (gloo on CPU, NCCL on GPU)
  <mode>+metric         (--metric) beside each ringtrain mode, the same mode also averaging the step's loss over
                        the ranks as a metric, the way training scripts log one: hvd.allreduce(loss.detach()),
                        unnamed and out of place, once per step. Interleaved in the same rounds as the mode without
                        it, so the two are a same-run A/B (paired_step_change); metric_ms is the call's own time
  <mode>+paired         (--metric) the same mode making two calls at that point every step: the user's ringtrain
                        call and MPI_Allreduce (mpi4py) of the same scalar, in ABBA order over the steps. Whichever
                        goes first waits there for the slowest rank to finish its step; the second finds the ranks
                        together and costs only itself (train_report.metric_table says why that is the metric's
                        cost to the step)
  horovod               horovod.torch.DistributedOptimizer, only where Horovod is installed (a benchmark peer, never
                        a dependency: benchmarks/build_horovod_peer.sh builds it into a venv of its own; run this
                        script with that venv's python). It is initialised for its own rounds only, so its
                        background thread does not run beside the other modes.
Scaling efficiency = T(N) / (N * T(1)) with T the total samples/s and T(1) the single-process plain-torch
throughput (the no-comm mode at N = 1), so every mode is measured against the same denominator. Each rank uses
--threads torch threads (default cores // max-ranks, i.e. the same per-rank share at every N).

Share of allreduce hidden behind backward (ringtrain-overlap): from the engine's own Handle.times, the part of the
union of [started, finished] intervals that lies before loss.backward() returned, over the whole union.
Correctness: distributed modes must end with identical parameters on every rank, and ringtrain's final
parameters must match DDP's (same seed, same data) to float tolerance; both are recorded and checked.
"""
import argparse
import contextlib
import importlib.util
import io
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import common
from train_models import MODELS, build_model, synthetic_batch
from train_report import METRIC, PAIR_SAMPLES, PAIRED, median_round, plot, print_report, summarise

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)
sys.path.append(REPO_ROOT)   # run from a source checkout without pip install

MODES = ("no-comm", "lockstep", "ringtrain-after-backward", "ringtrain-overlap", "torch-ddp", "horovod")
LOCAL_MODES = ("no-comm", "lockstep")   # no gradient traffic: each rank trains its own copy of the model
RINGTRAIN_OVERLAP = {"ringtrain-after-backward": False, "ringtrain-overlap": True}
DEFAULT_MODELS = ("convnet", "mlp")
PARAM_TOLERANCE = 1e-4       # ringtrain vs DDP final parameters: same math, different summation order


# ---------------------------------------------------------------- model and data

def model_width(args, model):
    return args.mlp_width if model == "mlp" else args.width


# ---------------------------------------------------------------- engine timestamps

class HandleRecorder:
    """Keeps every Handle that ringtrain's allreduce functions return, so their times can be read after step().

    The torch binding calls the core API through module attributes; wrapping those attributes in every loaded
    ringtrain module sees each handle without touching the binding's internals."""

    FUNCTIONS = ("allreduce_async", "grouped_allreduce_async")

    def __init__(self):
        self.handles = []
        self._patched = []

    def install(self):
        for module_name, module in list(sys.modules.items()):
            if module is None or not (module_name == "ringtrain" or module_name.startswith("ringtrain.")):
                continue
            for function in self.FUNCTIONS:
                original = getattr(module, function, None)
                if callable(original) and not getattr(original, "_recorded", False):
                    setattr(module, function, self._wrap(original))
                    self._patched.append((module, function, original))

    def _wrap(self, original):
        def recording(*args, **kwargs):
            handle = original(*args, **kwargs)
            self.handles.append(handle)
            return handle
        recording._recorded = True
        return recording

    def take(self):
        taken, self.handles = self.handles, []
        return taken

    def uninstall(self):
        for module, function, original in reversed(self._patched):
            setattr(module, function, original)
        self._patched = []


def interval_union(intervals):
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def hidden_seconds(handles, backward_end):
    """(seconds of allreduce before backward_end, total seconds of allreduce) from the handles' times."""
    intervals = []
    for handle in handles:
        times = getattr(handle, "times", None) or {}
        if "started" in times and "finished" in times:
            intervals.append((times["started"], times["finished"]))
    merged = interval_union(intervals)
    total = sum(end - start for start, end in merged)
    hidden = sum(max(0.0, min(end, backward_end) - start) for start, end in merged)
    return hidden, total


# ---------------------------------------------------------------- worker (one MPI rank)

def run_worker(args):
    import numpy as np
    import torch
    from mpi4py import MPI

    import ringtrain.torch as binding

    comm = MPI.COMM_WORLD
    rank, ranks = comm.Get_rank(), comm.Get_size()
    torch.set_num_threads(args.threads)
    modes = args.modes.split(",")
    horovod = load_horovod() if "horovod" in modes else None
    binding.init()
    ddp_backend = init_ddp(comm, torch)
    recorder = HandleRecorder()
    recorder.install()

    payload = {"ranks": ranks, "threads_per_rank": args.threads, "batch_per_rank": args.batch,
               "ddp_backend": ddp_backend, "models": {}}
    for model in args.models.split(","):
        width = model_width(args, model)
        inputs, labels = synthetic_batch(torch, model, width, rank, args.batch)
        rounds, final_params = {}, {}
        for round_index in range(args.rounds):
            for mode in modes:
                if mode == "horovod" and horovod is None:
                    continue
                measured, params = train_mode(mode, model, width, args, torch, comm, inputs, labels, binding,
                                              horovod, recorder)
                rounds.setdefault(mode, []).append(measured)
                if round_index == 0:
                    final_params[mode] = params
        results = {mode: median_round(measured) for mode, measured in rounds.items()}
        if "horovod" in modes and horovod is None:
            results["horovod"] = {"mode": "horovod", "skipped": HOROVOD_MISSING}

        # Distributed modes must agree with each other: same seed, same data, same averaged gradients.
        reference = final_params.get("torch-ddp")
        for mode, params in final_params.items():
            if mode in LOCAL_MODES or mode == "torch-ddp" or reference is None:
                continue
            results[mode]["max_param_diff_vs_ddp"] = float(np.max(np.abs(params - reference)))
        parameters = list(build_model(torch, model, width).parameters())
        payload["models"][model] = {"width": width, "parameters": sum(p.numel() for p in parameters),
                                    "tensors": len(parameters), "modes": results}

    recorder.uninstall()
    if ddp_backend:
        torch.distributed.destroy_process_group()
    binding.shutdown()
    if rank == 0:
        common.write_json(args.worker_json, payload)


HOROVOD_MISSING = "horovod.torch not installed (benchmarks/build_horovod_peer.sh)"


def load_horovod():
    """horovod.torch where installed, else None. An external peer: absent is a skip; installed but broken fails."""
    if importlib.util.find_spec("horovod") is None or importlib.util.find_spec("horovod.torch") is None:
        return None
    import horovod.torch as hvd
    return hvd


def pair_order(step):
    """Which call goes first at the metric point of this step: ringtrain, MPI, MPI, ringtrain, ... (ABBA), so a
    drift over the steps (caches, clocks, a neighbour's load) weighs on both calls' positions alike."""
    return ("ringtrain", "mpi") if step % 4 in (0, 3) else ("mpi", "ringtrain")


def init_ddp(comm, torch):
    """torch.distributed for DDP, gloo here (NCCL when every rank has its own GPU); address agreed over MPI."""
    import allreduce   # sibling benchmark: shares the env:// rendezvous helper
    backend = "nccl" if use_cuda(torch, comm) else "gloo"
    allreduce.init_torch_distributed(comm, backend)
    return backend


def use_cuda(torch, comm):
    from mpi4py import MPI
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local_size = local.Get_size()
    local.Free()
    return torch.cuda.is_available() and torch.cuda.device_count() >= local_size


def train_mode(mode, model_name, width, args, torch, comm, inputs, labels, binding, hvd, recorder):
    import numpy as np
    from mpi4py import MPI

    from ringtrain.torch.gradient_hooks import default_overlap

    metric = "paired" if mode.endswith(PAIRED) else mode.endswith(METRIC)
    mode = mode.removesuffix(PAIRED).removesuffix(METRIC)
    if mode == "horovod":
        hvd.init()   # its background thread runs for Horovod's own rounds only
    torch.manual_seed(0)
    model = build_model(torch, model_name, width)
    if mode == "torch-ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    # both models name a parameter "0.weight": the model's name keeps their allreduce names apart in one job
    named = [(f"{model_name}.{name}", p) for name, p in model.named_parameters()]
    default_here = None
    if mode in RINGTRAIN_OVERLAP:
        optimizer = binding.DistributedOptimizer(optimizer, named_parameters=named, overlap=RINGTRAIN_OVERLAP[mode])
        # would the optimizer's default (overlap=None) pick this schedule here? (overlap only if every rank would)
        chosen = comm.allreduce(default_overlap(list(model.parameters()), binding.local_size()), op=MPI.LAND)
        default_here = chosen == RINGTRAIN_OVERLAP[mode]
    if mode == "horovod":
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=named)
    loss_fn = torch.nn.CrossEntropyLoss()
    metric_s = [0.0]
    mpi_sum = np.zeros(1, np.float32)
    pair = {key: [] for key in PAIR_SAMPLES}
    steps_taken = [0]

    def ringtrain_metric(value):
        return binding.allreduce(value)

    def mpi_metric(value):
        comm.Allreduce(value.numpy().reshape(1), mpi_sum, op=MPI.SUM)
        return mpi_sum[0] / comm.Get_size()

    calls = {"ringtrain": ringtrain_metric, "mpi": mpi_metric}

    def step():
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), labels)
        loss.backward()
        backward_end = time.perf_counter()
        if mode == "lockstep":
            comm.Barrier()   # where a synchronous method reduces the gradients: wait for the slowest rank
        optimizer.step()
        if metric == "paired":   # both calls, the order by the step's index: the same on every rank
            value = loss.detach()
            for position, call in zip(("first", "second"), pair_order(steps_taken[0])):
                call_start = time.perf_counter()
                calls[call](value)
                pair[f"{call}_{position}"].append(time.perf_counter() - call_start)
        elif metric:             # the mean loss over the ranks, as a training script logs it
            metric_start = time.perf_counter()
            binding.allreduce(loss.detach())
            metric_s[0] += time.perf_counter() - metric_start
        steps_taken[0] += 1
        return backward_end

    for _ in range(args.warmup):
        step()
    recorder.take()
    metric_s[0] = 0.0
    for samples in pair.values():
        samples.clear()
    hidden = total_comm = 0.0
    after_backward = compute = 0.0
    comm.Barrier()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    for _ in range(args.steps):
        step_start = time.perf_counter()
        backward_end = step()
        step_end = time.perf_counter()
        after_backward += step_end - backward_end
        compute += backward_end - step_start
        if mode.startswith("ringtrain"):
            h, t = hidden_seconds(recorder.take(), backward_end)
            hidden += h
            total_comm += t
    elapsed = time.perf_counter() - start
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    # the job runs at the pace of its slowest rank
    elapsed = comm.allreduce(elapsed, op=MPI.MAX)
    hidden = comm.allreduce(hidden, op=MPI.SUM)
    total_comm = comm.allreduce(total_comm, op=MPI.SUM)

    params = np.concatenate([p.detach().reshape(-1).numpy() for p in model.parameters()])
    checksums = comm.allgather(float(np.abs(params).sum()))
    if mode == "horovod":
        hvd.shutdown()
    ranks = comm.Get_size()
    result = {"mode": mode + {False: "", True: METRIC, "paired": PAIRED}[metric], "ranks": ranks,
              "step_ms": 1e3 * elapsed / args.steps,
              "samples_per_s_per_rank": args.batch * args.steps / elapsed,
              "samples_per_s_total": ranks * args.batch * args.steps / elapsed,
              "after_backward_ms": 1e3 * after_backward / args.steps,
              # zero_grad + forward + backward, mean over ranks: does the computation itself slow down when the
              # ranks run in step (shared caches, memory bandwidth), apart from any waiting?
              "forward_backward_ms": 1e3 * comm.allreduce(compute, op=MPI.SUM) / ranks / args.steps,
              # fresh pages the process touched per step (all threads, mean over ranks): the allocator's state
              # (mmap threshold, heap trimming) can make plain torch fault in its largest tensors every step,
              # which costs milliseconds on a VM and differs between processes
              "page_faults_per_step": comm.allreduce(faults, op=MPI.SUM) / ranks / args.steps,
              # every distributed mode must leave the same weights on every rank
              "params_in_sync": mode in LOCAL_MODES or ranks == 1 or len(set(checksums)) == 1}
    if metric == "paired":
        # per step, the mean over ranks of each call's time (every rank ran the same positions in the same steps)
        result["pair"] = {key: (comm.allreduce(np.array(samples), op=MPI.SUM) / ranks).tolist()
                          for key, samples in pair.items()}
    elif metric:
        result["metric_ms"] = 1e3 * comm.allreduce(metric_s[0], op=MPI.SUM) / ranks / args.steps
    if mode.startswith("ringtrain"):
        # only asynchronous allreduces have handles with times: after backward, none (and nothing is hidden)
        result["allreduce_ms_per_step"] = 1e3 * total_comm / ranks / args.steps if total_comm > 0 else None
        result["hidden_share"] = hidden / total_comm if total_comm > 0 else None
        result["default"] = default_here
    return result, params


# ---------------------------------------------------------------- driver (no MPI here: it launches the jobs)

def mpiexec_path():
    beside_python = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    found = beside_python if os.path.exists(beside_python) else shutil.which("mpiexec")
    if not found:
        raise SystemExit("mpiexec not found next to this python nor on PATH; install mpich (pip) or a system MPI")
    return found


def launch(ranks, args, folder):
    worker_json = os.path.join(folder, f"ranks{ranks}.json")
    command = [mpiexec_path(), "-n", str(ranks), sys.executable, os.path.abspath(__file__), "--worker",
               "--worker-json", worker_json, "--threads", str(args.threads), "--batch", str(args.batch),
               "--width", str(args.width), "--mlp-width", str(args.mlp_width), "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--rounds", str(args.rounds), "--modes", args.modes,
               "--models", args.models]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    completed = subprocess.run(command, env=env, timeout=args.job_timeout, capture_output=True, text=True)
    if completed.returncode != 0:
        raise SystemExit(f"the {ranks}-rank job failed (exit {completed.returncode}):\n"
                         f"{completed.stdout[-4000:]}\n{completed.stderr[-4000:]}")
    payload = common.read_json(worker_json)
    payload["wall_s"] = time.perf_counter() - started
    # 1-minute load average when the job started and ended: the machine may be shared, so say how busy it was
    payload["load_average"] = [load_before, os.getloadavg()[0]]
    return payload


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-ranks", type=int, default=2)
    parser.add_argument("--json")
    parser.add_argument("--out", help="also write the report here, between lines giving the command, the start and "
                                      "end times, the load and the commit")
    parser.add_argument("--png")
    parser.add_argument("--quick", action="store_true", help="small models, few steps (< 1 minute)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per rank (default cores // max-ranks)")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--width", type=int, default=None, help="convnet's first conv channels (64 = 6.7 M parameters)"
                        " and resnet18's (64 = 11.2 M)")
    parser.add_argument("--mlp-width", type=int, default=None, help="mlp's layer width (54 = 0.31 M parameters)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None, help="repetitions of every mode; median is reported")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--metric", action="store_true",
                        help="beside each ringtrain mode, its twin that also averages the loss as a metric each step")
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"from {','.join(MODELS)}")
    parser.add_argument("--job-timeout", type=float, default=None, help="seconds per mpiexec job")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quick = args.quick
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // args.max_ranks)
    args.batch = args.batch or (8 if quick else 32)
    args.width = args.width or (16 if quick else 64)
    args.mlp_width = args.mlp_width or (16 if quick else 54)
    args.steps = args.steps or (4 if quick else 20)
    args.warmup = args.warmup or (2 if quick else 5)
    args.rounds = args.rounds or (1 if quick else 3)
    args.job_timeout = args.job_timeout or (100 if quick else 900)
    if args.metric:
        args.modes = ",".join(m + twin for m in args.modes.split(",")
                              for twin in (("", METRIC, PAIRED) if m in RINGTRAIN_OVERLAP else ("",)))
    metric_modes = tuple(m + twin for m in RINGTRAIN_OVERLAP for twin in (METRIC, PAIRED))
    for option, chosen, known in (("modes", args.modes, MODES + metric_modes), ("models", args.models, MODELS)):
        unknown = set(chosen.split(",")) - set(known)
        if unknown:
            parser.error(f"unknown {option} {sorted(unknown)}; choose from {list(known)}")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        run_worker(args)
        return 0
    if any(os.environ.get(v) for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")):
        raise SystemExit("run train_scaling.py without mpiexec: it launches one mpiexec job per rank count")
    machine = common.machine_info()
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    load_before = " ".join(f"{v:.2f}" for v in os.getloadavg())
    # the interpreter's version, not its path: a path would name this machine's directories in committed results
    print(f"# ringtrain {machine['commit']}, {machine['date']}, python {platform.python_version()}", flush=True)
    jobs = []
    with tempfile.TemporaryDirectory() as folder:
        for ranks in range(1, args.max_ranks + 1):
            jobs.append(launch(ranks, args, folder))
            load = jobs[-1]["load_average"]
            print(f"# {ranks} rank(s): done in {jobs[-1]['wall_s']:.1f} s, load average {load[0]:.2f} at start, "
                  f"{load[1]:.2f} at end", flush=True)
    records = summarise(jobs)
    if args.out:
        report = io.StringIO()
        with contextlib.redirect_stdout(report):
            print_report(records, jobs, args.rounds)
        print(report.getvalue(), end="")
        command = " ".join(["python", "benchmarks/train_scaling.py"] + (argv if argv is not None else sys.argv[1:]))
        with open(args.out, "w") as f:
            f.write(f"# {started} UTC start, commit {machine['commit']}, load before {load_before}\n# {command}\n"
                    f"{report.getvalue()}# {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC end, load "
                    f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}\n")
    else:
        print_report(records, jobs, args.rounds)
    if args.json:
        common.write_json(args.json, {"machine": machine, "records": records})
    if args.png:
        plot(records, args.png)
    bad = [r for r in records if "skipped" not in r and (not r["params_in_sync"] or
                                                          r.get("max_param_diff_vs_ddp", 0) > PARAM_TOLERANCE)]
    for r in bad:
        print(f"# WRONG: {r['model']} {r['ranks']} ranks {r['mode']}: parameters in sync {r['params_in_sync']}, "
              f"max |dw| vs DDP {r.get('max_param_diff_vs_ddp')}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
