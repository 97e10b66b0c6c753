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
                        it, so the two are a same-run A/B; metric_ms is the call's own time inside the step
  <mode>+mpimetric      (--metric) the same, the scalar averaged with MPI_Allreduce (mpi4py) at the same point:
                        what any allreduce after step() pays there (the wait for the slowest rank), so ringtrain's
                        own cost is metric_ms minus this twin's
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

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)
sys.path.append(REPO_ROOT)   # run from a source checkout without pip install

MODES = ("no-comm", "lockstep", "ringtrain-after-backward", "ringtrain-overlap", "torch-ddp", "horovod")
LOCAL_MODES = ("no-comm", "lockstep")   # no gradient traffic: each rank trains its own copy of the model
RINGTRAIN_OVERLAP = {"ringtrain-after-backward": False, "ringtrain-overlap": True}
METRIC = "+metric"           # a mode's twin that also averages a scalar metric every step (--metric)
MPI_METRIC = "+mpimetric"    # its twin that averages the same scalar through MPI_Allreduce instead (--metric)
MODELS = ("convnet", "mlp", "resnet18")
DEFAULT_MODELS = ("convnet", "mlp")
MLP_BLOCKS = 100             # 4 tensors per block + the head's 2: 402 gradient tensors at any width
PARAM_TOLERANCE = 1e-4       # ringtrain vs DDP final parameters: same math, different summation order


# ---------------------------------------------------------------- model and data

def build_model(torch, model, width):
    builders = {"convnet": build_convnet, "mlp": build_mlp, "resnet18": build_resnet18}
    return builders[model](torch, width)


def model_width(args, model):
    return args.mlp_width if model == "mlp" else args.width


def build_convnet(torch, width):
    """A small VGG-like convnet on 32x32 RGB: ~6.7 M parameters at width 64, most of them in the first linear
    layer, so the gradient (25 MB) is large enough for communication to matter against compute."""
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1), nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(2 * width, 4 * width, 3, stride=2, padding=1), nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * width * 8 * 8, 6 * width), nn.ReLU(),
        nn.Linear(6 * width, 10),
    )


def build_mlp(torch, width):
    """MLP_BLOCKS blocks of Linear(width, width) + LayerNorm + ReLU and a 10-way head: ~0.31 M parameters in 402
    tensors at width 54. Little compute per tensor, so what a framework pays per tensor decides the step time;
    the LayerNorms keep 100 layers trainable."""
    nn = torch.nn
    layers = []
    for _ in range(MLP_BLOCKS):
        layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def build_resnet18(torch, width):
    """ResNet-18 as torchvision lays it out (7x7 stem, max pool, four stages of two basic blocks, batch norm), on
    32x32 inputs with 10 classes: 11.2 M parameters in 62 tensors at width 64, 45 MB of gradients. The stem shrinks
    the image 4x, so a step computes about as long as the convnet's while its gradients are 1.7x larger."""
    nn = torch.nn

    class BasicBlock(nn.Module):
        def __init__(self, inputs, outputs, stride):
            super().__init__()
            self.conv1 = nn.Conv2d(inputs, outputs, 3, stride=stride, padding=1, bias=False)
            self.bn1 = nn.BatchNorm2d(outputs)
            self.conv2 = nn.Conv2d(outputs, outputs, 3, padding=1, bias=False)
            self.bn2 = nn.BatchNorm2d(outputs)
            self.downsample = None
            if stride != 1 or inputs != outputs:
                self.downsample = nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride=stride, bias=False),
                                                nn.BatchNorm2d(outputs))

        def forward(self, x):
            out = torch.relu(self.bn1(self.conv1(x)))
            out = self.bn2(self.conv2(out))
            return torch.relu(out + (x if self.downsample is None else self.downsample(x)))

    layers = [nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
              nn.MaxPool2d(3, stride=2, padding=1)]
    channels = width
    for stage in range(4):
        outputs = width << stage
        for block in range(2):
            layers.append(BasicBlock(channels, outputs, 2 if stage and not block else 1))
            channels = outputs
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10)]
    return nn.Sequential(*layers)


def synthetic_batch(torch, model, width, rank, batch):
    generator = torch.Generator().manual_seed(1234 + rank)
    shape = (batch, width) if model == "mlp" else (batch, 3, 32, 32)
    inputs = torch.randn(*shape, generator=generator)
    labels = torch.randint(0, 10, (batch,), generator=generator)
    return inputs, labels


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


def median_round(rounds):
    """A mode's rounds as one record: the median of each timing; parameters in sync only if they were every round."""
    record = dict(rounds[0])
    for key, value in rounds[0].items():
        if isinstance(value, float):
            values = [r[key] for r in rounds if r.get(key) is not None]
            record[key] = common.median(values) if values else None
    record["params_in_sync"] = all(r["params_in_sync"] for r in rounds)
    record["rounds"] = [r["samples_per_s_per_rank"] for r in rounds]
    return record


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

    metric = "mpi" if mode.endswith(MPI_METRIC) else mode.endswith(METRIC)
    mode = mode.removesuffix(MPI_METRIC).removesuffix(METRIC)
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

    def step():
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), labels)
        loss.backward()
        backward_end = time.perf_counter()
        if mode == "lockstep":
            comm.Barrier()   # where a synchronous method reduces the gradients: wait for the slowest rank
        optimizer.step()
        if metric:           # the mean loss over the ranks, as a training script logs it
            metric_start = time.perf_counter()
            if metric == "mpi":      # the same scalar at the same point through MPI: what any allreduce costs here
                comm.Allreduce(loss.detach().numpy().reshape(1), mpi_sum, op=MPI.SUM)
                mpi_sum[0] /= comm.Get_size()
            else:
                binding.allreduce(loss.detach())
            metric_s[0] += time.perf_counter() - metric_start
        return backward_end

    for _ in range(args.warmup):
        step()
    recorder.take()
    metric_s[0] = 0.0
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
    result = {"mode": mode + {False: "", True: METRIC, "mpi": MPI_METRIC}[metric], "ranks": ranks, "step_ms": 1e3 * elapsed / args.steps,
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
    if metric:
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


def summarise(jobs):
    """Flat records, one per (model, ranks, mode), with efficiency against that model's single-process
    plain-torch throughput."""
    single = next((j for j in jobs if j["ranks"] == 1), None)
    records = []
    for job in jobs:
        for model, measured in job["models"].items():
            own_base = {m: r.get("samples_per_s_total") for m, r in single["models"][model]["modes"].items()} \
                if single else {}
            base = own_base.get("no-comm")
            for mode, r in measured["modes"].items():
                if "skipped" in r:
                    records.append({"model": model, "mode": mode, "ranks": job["ranks"], "skipped": r["skipped"]})
                    continue
                n = job["ranks"]
                record = dict(r, model=model, threads_per_rank=job["threads_per_rank"],
                              load_average=job.get("load_average"),
                              batch_per_rank=job["batch_per_rank"], parameters=measured["parameters"],
                              tensors=measured["tensors"], width=measured["width"], ddp_backend=job["ddp_backend"])
                record["efficiency"] = r["samples_per_s_total"] / (n * base) if base else None
                record["efficiency_vs_own_1rank"] = (r["samples_per_s_total"] / (n * own_base[mode])
                                                     if own_base.get(mode) else None)
                records.append(record)
    return records


def print_report(records, jobs, rounds):
    job = jobs[0]
    for model in dict.fromkeys(r["model"] for r in records):
        rows = []
        measured = [r for r in records if r["model"] == model and "skipped" not in r]
        for r in (r for r in records if r["model"] == model):
            if "skipped" in r:
                rows.append([r["ranks"], r["mode"]] + ["-"] * 9 + [f"skipped: {r['skipped']}"])
                continue
            hidden = r.get("hidden_share")
            rows.append([r["ranks"], r["mode"] + ("*" if r.get("default") else ""), f"{r['step_ms']:.1f}",
                         _ms(r.get("forward_backward_ms")), _ms(r.get("after_backward_ms")),
                         f"{r['samples_per_s_per_rank']:.1f}",
                         f"{r['samples_per_s_total']:.1f}", _pct(r["efficiency"]),
                         _pct(r["efficiency_vs_own_1rank"]), "-" if hidden is None else _pct(hidden),
                         "-" if r.get("page_faults_per_step") is None else f"{r['page_faults_per_step']:.0f}",
                         ("in sync" if r["params_in_sync"] else "RANKS DIFFER") +
                         (f", |dw vs ddp| {r['max_param_diff_vs_ddp']:.1e}" if "max_param_diff_vs_ddp" in r else "")])
        shape = measured[0] if measured else {"parameters": 0, "tensors": 0}
        print(common.format_table(
            ["ranks", "mode", "step_ms", "fwd_bwd_ms", "after_bwd_ms", "samples/s/rank", "samples/s", "efficiency",
             "eff_own_T1", "hidden", "faults/step", "check"], rows,
            title=f"training scaling, {model}: {shape['parameters'] / 1e6:.2f} M parameters in {shape['tensors']} "
                  f"tensors, batch {job['batch_per_rank']} per rank, {job['threads_per_rank']} thread(s) per rank, "
                  f"{os.cpu_count()} cores, median of {rounds} interleaved round(s); efficiency = T(N)/(N*T(1)), "
                  f"T(1) = plain torch on 1 rank; * = the DistributedOptimizer's default schedule here; fwd_bwd_ms = "
                  f"zero_grad+forward+backward, after_bwd_ms = the rest of the step (means over ranks)"))
        print()
    print(target_table(records))
    if any(r["mode"].endswith((METRIC, MPI_METRIC)) for r in records):
        print()
        print(metric_table(records))


def metric_table(records):
    """What averaging one scalar metric per step costs each mode that ran with and without it: the call's own time
    inside the step as a share of the step without it, and the step times of the twins (same rounds). Beside it the
    same scalar averaged through MPI_Allreduce at the same point of the step (the +mpimetric twin): any allreduce
    there waits for the slowest rank to finish its step, so MPI's time is mostly that wait (at one rank: a cold
    call after the step's computation evicted the caches), and metric_us minus it is what ringtrain's call adds."""
    rows = []
    for r in records:
        if not r["mode"].endswith(METRIC) or "skipped" in r:
            continue
        key = (r["model"], r["ranks"])
        twins = {b["mode"]: b for b in records if (b["model"], b["ranks"]) == key and "skipped" not in b}
        plain = r["mode"].removesuffix(METRIC)
        base, mpi = twins.get(plain), twins.get(plain + MPI_METRIC)
        if base is None:
            continue
        # per round: samples/s without over with (the twins ran back to back), median over rounds
        paired = sorted(b / m for b, m in zip(base["rounds"], r["rounds"]))
        excess = None if mpi is None else r["metric_ms"] - mpi["metric_ms"]
        rows.append([r["model"], r["ranks"], base["mode"], f"{base['step_ms']:.2f}", f"{r['step_ms']:.2f}",
                     f"{1e3 * r['metric_ms']:.1f}", f"{100 * r['metric_ms'] / base['step_ms']:.2f}%",
                     "-" if mpi is None else f"{1e3 * mpi['metric_ms']:.1f}",
                     "-" if excess is None else f"{1e3 * excess:.1f}",
                     "-" if excess is None else f"{100 * excess / base['step_ms']:.2f}%",
                     f"{100 * (common.median(paired) - 1):+.1f}%"])
    return common.format_table(
        ["model", "ranks", "mode", "step_ms", "step_ms+metric", "metric_us", "metric_share", "mpi_metric_us",
         "excess_us", "excess_share", "paired_step_change"],
        rows, title="a scalar metric averaged every step (hvd.allreduce(loss.detach()), unnamed, out of place): "
                    "metric_us = the call's own time per step (mean over ranks), metric_share = that over the step "
                    "without it; mpi_metric_us = MPI_Allreduce of the same scalar at the same point (the wait for "
                    "the slowest rank that any allreduce there pays), excess = metric_us minus it; "
                    "paired_step_change = median over rounds of the step time with it over without it")


def target_table(records):
    """Issue 10's training targets at the largest rank count: efficiency within 5 points of the no-comm ceiling,
    and at least 1.3x DDP's throughput, for every model, with every figure from this same run. Beside them, the
    points below the lockstep mode (the synchronous ceiling): the part of the gap the method itself costs."""
    top = max(r["ranks"] for r in records)
    rows = []
    for model in dict.fromkeys(r["model"] for r in records):
        by_mode = {r["mode"]: r for r in records if r["model"] == model and r["ranks"] == top and "skipped" not in r}
        ceiling = by_mode.get("no-comm", {}).get("efficiency")
        lockstep = by_mode.get("lockstep", {}).get("efficiency")
        ddp = by_mode.get("torch-ddp", {}).get("samples_per_s_total")
        for mode, r in by_mode.items():
            if mode == "no-comm":
                continue
            rows.append([model, mode + ("*" if r.get("default") else ""), _pct(r["efficiency"]), _pct(ceiling),
                         _points_below(ceiling, r["efficiency"]), _pct(lockstep),
                         "-" if mode == "lockstep" else _points_below(lockstep, r["efficiency"]),
                         f"{r['samples_per_s_total'] / ddp:.2f}" if ddp else "-"])
    return common.format_table(
        ["model", "mode", "efficiency", "ceiling", "points_below_ceiling", "lockstep", "points_below_lockstep",
         "x_ddp_throughput"], rows,
        title=f"{top} ranks against the targets (<= 5 points below the ceiling, >= 1.3x DDP); lockstep = "
              f"the synchronous ceiling (a barrier per step, no gradients), for the part of the gap that is the "
              f"method's own")


def _points_below(ceiling, efficiency):
    return "-" if ceiling is None or efficiency is None else f"{100 * (ceiling - efficiency):.1f}"


def _ms(value):
    return "-" if value is None else f"{value:.1f}"


def _pct(value):
    return "-" if value is None else f"{100 * value:.0f}%"


def plot(records, path):
    plt = common.pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    series = list(dict.fromkeys((r["model"], r["mode"]) for r in records if "skipped" not in r))
    for model, mode in series:
        points = sorted((r["ranks"], r["samples_per_s_total"], r["efficiency"]) for r in records
                        if (r["model"], r["mode"]) == (model, mode) and "skipped" not in r)
        style = "-" if model == "convnet" else "--"
        left.plot([p[0] for p in points], [p[1] for p in points], style, marker="o", label=f"{model} {mode}")
        right.plot([p[0] for p in points], [100 * (p[2] or 0) for p in points], style, marker="o",
                   label=f"{model} {mode}")
    left.set_xlabel("ranks")
    left.set_ylabel("samples/s (total)")
    left.set_yscale("log")
    right.set_xlabel("ranks")
    right.set_ylabel("scaling efficiency (%)")
    right.set_ylim(0, 110)
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"training scaling on {os.cpu_count()} cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
                              for twin in (("", METRIC, MPI_METRIC) if m in RINGTRAIN_OVERLAP else ("",)))
    metric_modes = tuple(m + twin for m in RINGTRAIN_OVERLAP for twin in (METRIC, MPI_METRIC))
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
