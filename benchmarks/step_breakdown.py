"""Where a synchronous training step's time goes, against lockstep: the same step with one MPI barrier in place of
the gradient allreduce (no gradient traffic) -- what every synchronous method pays, and nothing more.

    mpiexec -n 2 python benchmarks/step_breakdown.py [--model convnet|mlp|resnet18] [--rounds 3] [--steps 15]
        [--modes no-comm,lockstep,lockstep+traffic,lockstep+traffic:views,after-backward,overlap,ddp]
        [--no-phases] [--json out.json]

Modes, interleaved in rounds whose order alternates (ABBA; one model and optimizer per mode, training on through
its rounds; the medians over rounds reported). x lockstep is lockstep's median step over the mode's; (paired) the
median over rounds of that ratio taken round by round, which cancels load that changes between rounds; x
lockstep+traffic (and :views) the same against that mode (the floor of an allreduce's memory traffic):
  no-comm         plain torch, no synchronisation at all (the ranks drift apart): does the computation itself run
                  slower when the ranks run in step (shared caches, memory bandwidth)? compare its fwd+bwd cpu
  lockstep        plain torch optimizer; after backward an MPI barrier (the synchronous ceiling)
  lockstep+traffic  lockstep plus, on each rank, the memory traffic any allreduce of the model's gradients among
                  the ranks must move (see AllreduceTraffic): the floor under every allreduce on these cores, with
                  no synchronisation beyond lockstep's barrier and no per-tensor or bookkeeping work; the
                  gradients private, as backward leaves them (copied into the window)
  lockstep+traffic:views  the same with every gradient a view of the window all along (zeroed there, added to by
                  backward): no copy-in
  after-backward  ringtrain.torch.DistributedOptimizer(overlap=False): synchronize() reduces after backward
  overlap         DistributedOptimizer(overlap=True): buckets are reduced from hooks during backward
  ddp             torch.nn.parallel.DistributedDataParallel (gloo): its allreduces run inside backward()
A ringtrain mode may name variants, for same-run A/Bs of one setting (after-backward:sleepy):
  :sleepy         the caller's waits sleep after 0.2 ms, as the engine thread's do, instead of polling
  :views          every bucket keeps its gradients as views (zeroed by zero_grad, added to by backward)
  :refill         after backward, every host bucket is refilled by a copy (its gradients dropped by zero_grad)
  :copied         a refilled bucket's fresh gradients are copied into the bucket and reduced there, instead of
                  reduced from where they lie into the bucket
  :packed         as :copied for a refilled bucket of several gradients only (one gradient: reduced from it)
  :allhooks       after backward, every parameter keeps its hook (not one per bucket after the first step)
  :alone          after backward, every gradient of 1 MB or more travels alone (not in buckets of such gradients)
  :paramhooks     after backward, the first step hooks every parameter itself (not its gradient accumulator): the
                  removed hooks keep costing in every later backward
  :capped         after backward, buckets of such gradients hold up to bucket_cap_mb (25 MB), not up to the
                  fusion threshold (the shm window's 32 MB)
  :bucketorder    after backward, step() reduces the buckets in bucket order (not the last first)
  :parked         the engine's background thread cannot run a pass during zero_grad + forward + backward (the
                  caller holds its progress lock): what its wake-ups cost the computation
No barrier between steps: each step has exactly one synchronisation point, as in training. Per step and rank:
  fwd+bwd         zero_grad + forward + backward (wall; cpu = this thread's CPU time, which excludes time the OS
                  gave to other processes, so cpu < wall means the rank was descheduled)
  wait            until the last rank finished its fwd+bwd (0 on the slowest rank): the ranks' imbalance
  after_last      from the last rank's end of backward until this rank leaves synchronize() / the barrier: the
                  communication that nothing hides, plus the time to notice it ended (wake-up)
  step            the wrapped optimizer's step()
  engine_cpu      CPU time of ringtrain's engine thread per step (it runs the allreduces of overlap; otherwise it
                  only polls)
  proc_cpu        CPU time of the whole process per step, every thread (DDP's gloo threads, ringtrain's engine)
  faults          minor page faults per step, all threads: fresh pages touched (allocator churn costs ms on a VM)
ringtrain's own time, per bucket phase (sum per step over the buckets; exclusive: a phase's time excludes the
phases it calls), on the training thread and on the engine thread, wall (and CPU in the JSON):
  zero            zeroing the gradient buckets in zero_grad() (the gradients are views of the buckets, so backward
                  accumulates into them: that add is inside fwd+bwd, not here)
  pack            copying gradients into a bucket (only when a .grad is not a view of its bucket)
  python          the binding's and engine's own Python around a bucket: hooks' submits, synchronize(), the request,
                  handle and action bookkeeping -- everything of ringtrain's not in another phase
  agree           the agreement cycle: publishing this rank's slot and waiting for every rank's (so it holds the
                  wait for the slowest rank, and the wake-up after it)
  transport       the allreduce itself (shm: copy-in where needed, reduce, push, the two flag barriers)
  slots           a small allreduce reduced from the agreement cycle's slots
  unpack          copying results back (only when a bucket's result is not where its gradients are)
  handle_wait     the training thread waiting for a bucket the engine thread is running (overlap)
Memory traffic: this VM exposes no hardware counters (perf reports "not supported"), so traffic is given as the
bytes the step's gradient buckets hold and the rate the transport moved them at (algbw); each of zero, transport
and the accumulate into a bucket streams them once or more.
--no-phases runs without the timers (each costs a few microseconds per call).
wait and after_last compare perf_counter() stamps of different processes: valid on one host only (all ranks of the
job on one node; otherwise they are left out); DDP has no stamp where the ranks meet (its allreduces end inside
backward()), so its communication shows in fwd+bwd. On a machine shared with other work, compare modes within one run.
"""
import argparse
import contextlib
import functools
import json
import os
import resource
import sys
import threading
import time

import numpy as np
import torch
from mpi4py import MPI

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
sys.path.append(os.path.dirname(BENCH_DIR))

import train_scaling  # noqa: E402  (the same models and data as the scaling benchmark)

import ringtrain  # noqa: E402
import ringtrain.torch as hvd  # noqa: E402
from ringtrain.engine import cycle_agreement, executor, watchdog
from ringtrain.reducer import reducer
from ringtrain.core import state  # noqa: E402
from ringtrain.torch import gradient_hooks as torch_optimizer  # noqa: E402
from ringtrain.transports.mpi_util import pieces  # noqa: E402
from ringtrain.transports.shm import SharedMemoryTransport  # noqa: E402

WARMUP = 5
TRAFFIC = "lockstep+traffic"
MODES = ("no-comm", "lockstep", TRAFFIC, "after-backward", "overlap", "ddp")
DEFAULT_MODES = ("no-comm", "lockstep", TRAFFIC, TRAFFIC + ":views", "after-backward", "overlap", "ddp")
LOCAL_MODES = ("no-comm", "lockstep", TRAFFIC)   # the plain torch optimizer, no ringtrain
RINGTRAIN_MODES = ("after-backward", "overlap")
PHASES = ("step_wall", "fwd_bwd", "fwd_bwd_cpu", "wait", "after_last", "step", "engine_cpu", "proc_cpu", "faults")
BUCKET_PHASES = ("zero", "pack", "python", "agree", "transport", "slots", "unpack", "handle_wait")
THREADS = ("caller", "engine")


class PhaseClock:
    """Timers around the few ringtrain functions a bucket passes through, summed per (thread, phase).

    Exclusive times: a timed function called inside another (the transport inside synchronize()) is subtracted
    from its caller's phase, so the phases of one thread add up to the time ringtrain spent on it. Wall and CPU
    (this thread's) seconds; sums only grow, the benchmark takes differences per step."""

    # (owner, attribute, phase, static): the functions timed
    TARGETS = (
        (torch_optimizer.GradientHooks, "zero_grad", "zero", False),
        (torch_optimizer.GradientHooks, "_into_buffer", "pack", True),
        (torch_optimizer.GradientHooks, "submit", "python", False),
        (torch_optimizer.GradientHooks, "synchronize", "python", False),
        (torch_optimizer.GradientHooks, "_unpack_flat", "unpack", True),
        (torch_optimizer.GradientHooks, "_unpack_each", "unpack", True),
        (reducer.Reducer, "wait", "handle_wait", False),
        (cycle_agreement.CycleAgreement, "_exchange_slots", "agree", False),
        (cycle_agreement.CycleAgreement, "_slow_cycle", "agree", False),
        (executor.Executor, "reduce_slots", "slots", False),
    )

    def __init__(self):
        self.totals = {(t, p): [0.0, 0.0] for t in THREADS for p in BUCKET_PHASES}
        self._local = threading.local()
        self._patched = []

    def install(self, transport_class):
        transport = tuple((transport_class, attribute, "transport", False)
                          for attribute in ("allreduce_out", "allreduce_segments"))
        for owner, attribute, phase, static in self.TARGETS + transport:
            original = owner.__dict__.get(attribute)     # None: inherited (uninstall then deletes the timer)
            function = getattr(owner, attribute)
            timed = self._timed(function, phase)
            setattr(owner, attribute, staticmethod(timed) if static else timed)
            self._patched.append((owner, attribute, original))

    def uninstall(self):
        for owner, attribute, original in reversed(self._patched):
            if original is None:
                delattr(owner, attribute)
            else:
                setattr(owner, attribute, original)
        self._patched = []

    def snapshot(self):
        return {key: tuple(value) for key, value in self.totals.items()}

    def _timed(self, function, phase):
        clock = self

        @functools.wraps(function)
        def timed(*args, **kwargs):
            local = clock._local
            stack = getattr(local, "stack", None)
            if stack is None:
                stack = local.stack = []
                local.thread = "engine" if threading.current_thread().name == "ringtrain-engine" else "caller"
            frame = [0.0, 0.0]          # the time of timed functions called from this one
            stack.append(frame)
            w0, c0 = time.perf_counter(), time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                wall, cpu = time.perf_counter() - w0, time.thread_time() - c0
                stack.pop()
                total = clock.totals[(local.thread, phase)]
                total[0] += wall - frame[0]
                total[1] += cpu - frame[1]
                if stack:
                    stack[-1][0] += wall
                    stack[-1][1] += cpu
        return timed


class AllreduceTraffic:
    """The memory traffic an allreduce of the float32 gradients of `parameters` among the N ranks of one node must
    move, per rank, done on buffers allocated once: what is left of an allreduce when its synchronisation (but for
    one barrier), its per-tensor calls and its bookkeeping are taken away.

    Each rank has a buffer W of the gradients' size S in an MPI shared-memory window, as ringtrain's buckets are;
    rank r owns block r (1/N of the elements). Where the gradients lie decides the traffic:
    private (views=False): backward leaves them in the process's private memory; they stand as one private buffer G
      copy_in   W_r[block p] <- G[block p] for every peer p: a peer cannot read G   read and write (N-1)/N S
      (the one barrier: every rank's copy-in is done)
      reduce    W_r[block r] <- (G[block r] + the W_q[block r] of every peer q) / N, pushed into every W_q[block r],
                piece by cache-sized piece (the piece is re-read from cache)        read S, write S
      hand_over points each parameter's .grad at its piece of W_r, where the optimizer reads the result (as ringtrain
      does with a refilled bucket's), instead of copying it back into G
      so (2N-1)/N S read and as much written per rank: 1.5 S each on 2 ranks.
    views (views=True): each .grad is a view of W_r all along (as ringtrain's buckets of small gradients are):
      zeroing W_r (write S) replaces dropping the .grad, and backward adds into the views (it reads S more than when
      it hands over fresh gradients); no copy-in; the reduce reads S and writes S in place. That is 2 S each in all,
      more than private, but without the copy-in after backward.
    Among allreduces whose every rank holds its own result, these are the least traffic: a peer can read only what
    is in shared memory, every input element is read once, and every element of the result lands in every rank's W.
    One result shared by the ranks (each owner writes its block once, S/N instead of S) writes less; built and
    measured in ringtrain, its transport was 0.35-1.05 ms faster on the convnets and the optimizer's step 0.15-0.7 ms
    slower, reading the result from the peers' memory (benchmarks/results/shared_result_ab_summary.txt).
    Once, when made, it checks that it computes an allreduce (every rank's W is then the average of the ranks'
    gradients); then the gradients are zeroed: the optimizer applies zero gradients (the same arithmetic as any),
    since G is not the model's gradients and the values in views mode would be the check's."""

    def __init__(self, parameters, comm, views=False):
        self.parameters = list(parameters)
        self.views = views
        count = sum(p.numel() for p in self.parameters)
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        page_multiple = -(-count * 4 // 4096) * 4096
        self._win = MPI.Win.Allocate_shared(page_multiple, 4, comm=comm)
        self.windows = [np.frombuffer(self._win.Shared_query(p)[0], np.float32)[:count] for p in range(self.size)]
        self.gradients = self.windows[self.rank] if views else np.empty(count, np.float32)
        self.gradients[:] = self.rank + 1
        self.blocks = [(count * p // self.size, count * (p + 1) // self.size) for p in range(self.size)]
        self.piece = SharedMemoryTransport.cache_piece_bytes // 4
        comm.Barrier()
        self.copy_in()
        comm.Barrier()
        self.reduce()
        comm.Barrier()
        wrong = np.count_nonzero(self.windows[self.rank] != (self.size + 1) / 2)
        if comm.allreduce(wrong):
            raise AssertionError(f"rank {self.rank}: {TRAFFIC} left {wrong} of {count} elements unlike an allreduce")
        self.gradients[:] = 0
        self.windows[self.rank][:] = 0
        flat = torch.from_numpy(self.windows[self.rank])
        starts = np.cumsum([0] + [p.numel() for p in self.parameters])
        self.results = [flat[lo:lo + p.numel()].view(p.shape) for lo, p in zip(starts, self.parameters)]
        if views:
            self._point_grads()
        comm.Barrier()

    def zero_grad(self):
        """views: zero W_r (the .grad stay views of it)"""
        self.windows[self.rank].fill(0)

    def hand_over(self):
        if not self.views:
            self._point_grads()

    def _point_grads(self):
        for p, result in zip(self.parameters, self.results):
            p.grad = result

    def copy_in(self):
        if self.views:
            return
        mine = self.windows[self.rank]
        for p, (lo, hi) in enumerate(self.blocks):
            if p != self.rank:
                mine[lo:hi] = self.gradients[lo:hi]

    def reduce(self):
        lo, hi = self.blocks[self.rank]
        result = self.windows[self.rank]
        peers = [w for q, w in enumerate(self.windows) if q != self.rank]
        for start, stop in pieces(hi - lo, self.piece):
            a, b = lo + start, lo + stop
            np.add(self.gradients[a:b], peers[0][a:b], out=result[a:b])
            for peer in peers[1:]:
                np.add(result[a:b], peer[a:b], out=result[a:b])
            np.multiply(result[a:b], 1.0 / self.size, out=result[a:b])
            for peer in peers:
                peer[a:b] = result[a:b]

    def free(self):
        if self.views and any(p.grad is None or p.grad.data_ptr() != r.data_ptr()
                              for p, r in zip(self.parameters, self.results)):
            raise AssertionError(f"rank {self.rank}: {TRAFFIC}:views: backward did not add into the window")
        self.windows = self.results = None
        for p in self.parameters:
            p.grad = None
        self._win.Free()


def engine_cpu_clock():
    """A function returning the CPU seconds of ringtrain's engine thread so far (None if it cannot be found)."""
    threads = [t for t in threading.enumerate() if t.name == "ringtrain-engine"]
    if not threads or not hasattr(time, "pthread_getcpuclockid"):
        return lambda: None
    clock = time.pthread_getcpuclockid(threads[0].ident)
    return lambda: time.clock_gettime(clock)


def minor_faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def process_cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# Variants of a ringtrain mode for same-run A/Bs ("after-backward:sleepy"): what each sets, as (setting, value)
VARIANTS = {
    "sleepy": ("caller_yield_s", 0.0),                      # the caller's waits sleep after 0.2 ms, as the engine's
    "views": ("refill_min_tensor_bytes", float("inf")),     # every bucket keeps its gradients as views
    "refill": ("refill_min_tensor_bytes", 0),               # after backward every host bucket is refilled
    "copied": ("reduce_into_buffer", False),                # refilled buckets: copy in, then reduce in place
    "packed": ("reduce_into_buffer", "one"),                # only a refilled bucket of one gradient reduced from it
    "allhooks": ("one_hook_per_bucket", False),             # after backward every parameter keeps its hook
    "alone": ("large_alone", True),                         # after backward every large gradient alone
    "paramhooks": ("node_hooks_first_step", False),         # after backward, step 1 hooks the parameters
    "capped": ("large_bucket_bytes", None),                 # after backward large buckets up to bucket_cap_mb
    "bucketorder": ("last_ready_first", False),             # after backward buckets reduced in bucket order
    "parked": ("park_engine", True),                        # the engine thread held off during fwd+bwd
}


def references(modes):
    """The modes every other mode's step is compared with: lockstep and the traffic floors."""
    return ["lockstep"] + [m for m in modes if split_mode(m)[0] == TRAFFIC]


def split_mode(mode):
    """'after-backward:sleepy' -> ('after-backward', ['sleepy'])."""
    base, _, variants = mode.partition(":")
    return base, variants.split("+") if variants else []


def settings(mode):
    return dict(VARIANTS[v] for v in split_mode(mode)[1])


@contextlib.contextmanager
def variant_applied(mode):
    """Process-wide settings of a mode's variants, restored afterwards."""
    value = settings(mode).get("caller_yield_s")
    if value is None:
        yield
        return
    saved = watchdog.CALLER_YIELD_S
    watchdog.CALLER_YIELD_S = value
    try:
        yield
    finally:
        watchdog.CALLER_YIELD_S = saved


def build(mode, args, comm):
    """(model, optimizer, AllreduceTraffic of lockstep+traffic or None) of one mode, every mode from the same seed."""
    base = split_mode(mode)[0]
    torch.manual_seed(0)
    model = train_scaling.build_model(torch, args.model, args.width)
    if base == TRAFFIC:
        traffic = AllreduceTraffic(model.parameters(), comm, views="views" in split_mode(mode)[1])
        return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), traffic
    if base == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if base in RINGTRAIN_MODES:
        named = [(f"{mode}.{name}", p) for name, p in model.named_parameters()]
        plan = reducer.plan_buckets
        if settings(mode).get("large_alone"):
            reducer.plan_buckets = functools.partial(plan, large_alone=True)
        try:
            optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=named, overlap=(base == "overlap"))
        finally:
            reducer.plan_buckets = plan
        refill = settings(mode).get("refill_min_tensor_bytes")
        if refill is not None:
            optimizer._ringtrain.refill_min_tensor_bytes = refill
        into = settings(mode).get("reduce_into_buffer")
        if into is not None:
            hooks = optimizer._ringtrain
            reduce_into = hooks._reduce_into_buffer
            hooks._reduce_into_buffer = lambda bucket, grads, sync: (into == "one" and len(grads) == 1
                                                                     and reduce_into(bucket, grads, sync))
        if "large_bucket_bytes" in settings(mode):
            optimizer._ringtrain.reducer.large_bucket_bytes = settings(mode)["large_bucket_bytes"]
            optimizer._ringtrain.restart()          # the plan again, with that cap
        if settings(mode).get("last_ready_first") is False:
            owner = optimizer._ringtrain.reducer
            in_order = owner.submit_remaining
            owner.submit_remaining = lambda submit_bucket, last_ready_first=False: in_order(submit_bucket)
        if settings(mode).get("one_hook_per_bucket") is False:
            optimizer._ringtrain.hook_one_parameter_per_bucket = lambda: None
        if settings(mode).get("node_hooks_first_step") is False:
            optimizer._ringtrain.node_hooks_first_step = False
            optimizer._ringtrain.install_hooks()     # step 1's hooks on the parameters themselves
    return model, optimizer, None


def run_mode(mode, model, optimizer, traffic, args, comm, inputs, labels, engine_cpu, clock):
    """Stamps of every measured step on this rank: (t0, backward_end, synchronized, stepped, cpu phases...,
    {(thread, phase): (wall, cpu)} of the step)."""
    with variant_applied(mode):
        return _run_mode(mode, model, optimizer, traffic, args, comm, inputs, labels, engine_cpu, clock)


def _run_mode(mode, model, optimizer, traffic, args, comm, inputs, labels, engine_cpu, clock):
    base = split_mode(mode)[0]
    loss_fn = torch.nn.CrossEntropyLoss()
    stamps = []
    # :parked -- a thread blocked on a lock takes neither the GIL nor a core
    parking = state.engine()._progress_lock if settings(mode).get("park_engine") else contextlib.nullcontext()
    zero_grad = traffic.zero_grad if traffic is not None and traffic.views else optimizer.zero_grad
    comm.Barrier()
    for i in range(WARMUP + args.steps):
        faults, engine0, proc0 = minor_faults(), engine_cpu(), process_cpu()
        phases0 = clock.snapshot() if clock is not None else None
        t0, c0 = time.perf_counter(), time.thread_time()
        with parking:
            zero_grad()
            loss_fn(model(inputs), labels).backward()
        t1, c1 = time.perf_counter(), time.thread_time()
        if base == "lockstep":
            comm.Barrier()
        elif base == TRAFFIC:
            traffic.copy_in()
            comm.Barrier()
            traffic.reduce()
            traffic.hand_over()
        elif base in RINGTRAIN_MODES:
            optimizer.synchronize()
        t2 = time.perf_counter()
        if base in RINGTRAIN_MODES:
            with optimizer.skip_synchronize():
                optimizer.step()
        else:
            optimizer.step()
        t3 = time.perf_counter()
        engine1 = engine_cpu()
        if i >= WARMUP:
            bucket = None
            if phases0 is not None and base in RINGTRAIN_MODES:
                now = clock.snapshot()
                bucket = {f"{t}.{p}": [now[(t, p)][0] - phases0[(t, p)][0], now[(t, p)][1] - phases0[(t, p)][1]]
                          for t, p in now}
            stamps.append((t0, t1, t2, t3, c1 - c0, None if engine0 is None else engine1 - engine0,
                           minor_faults() - faults, process_cpu() - proc0, bucket))
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    buckets = None
    if base in RINGTRAIN_MODES:
        buckets = [[len(b.members), sum(m.nbytes for m in b.members)] for b in optimizer._ringtrain.reducer.buckets]
    return {"stamps": stamps, "gradient_bytes": nbytes, "buckets": buckets}


def phases(everyone, one_host):
    """Per-phase medians (ms, mean over ranks of each rank's median) from every rank's stamps of one mode/round."""
    a = np.array([[row[:5] for row in rank] for rank in everyone], dtype=float)     # ranks x steps x 5
    steps = a.shape[1]
    last_arrival = a[:, :, 1].max(axis=0)
    result = {
        "step_wall": 1e3 * (a[:, -1, 3].max() - a[:, 0, 0].min()) / steps,
        "fwd_bwd": 1e3 * np.median(a[:, :, 1] - a[:, :, 0], axis=1).mean(),
        "fwd_bwd_cpu": 1e3 * np.median(a[:, :, 4], axis=1).mean(),
        "step": 1e3 * np.median(a[:, :, 3] - a[:, :, 2], axis=1).mean(),
        "wait": 1e3 * np.median(last_arrival - a[:, :, 1], axis=1).mean() if one_host else None,
        "after_last": 1e3 * np.median(a[:, :, 2] - last_arrival, axis=1).mean() if one_host else None,
        "faults": float(np.mean([np.median([row[6] for row in rank]) for rank in everyone])),
        "proc_cpu": 1e3 * float(np.mean([np.median([row[7] for row in rank]) for rank in everyone])),
    }
    engine = [[row[5] for row in rank] for rank in everyone]
    result["engine_cpu"] = (None if any(v is None for rank in engine for v in rank)
                            else 1e3 * float(np.mean([np.median(rank) for rank in engine])))
    if everyone[0][0][8] is not None:
        # per rank: the median step's phase times; then the mean over ranks (ms), [wall, cpu]
        keys = everyone[0][0][8].keys()
        result["buckets"] = {key: [1e3 * float(np.mean([np.median([row[8][key][i] for row in rank])
                                                          for rank in everyone])) for i in (0, 1)]
                             for key in keys}
        # and every rank's own wall times, to see which rank waits for which
        result["buckets_per_rank"] = [{key: 1e3 * float(np.median([row[8][key][0] for row in rank]))
                                       for key in keys} for rank in everyone]
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="convnet", choices=train_scaling.MODELS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--width", type=int, default=None, help="default: the scaling benchmark's (64, mlp 54)")
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES))
    parser.add_argument("--no-phases", action="store_true", help="no timers around ringtrain's functions")
    parser.add_argument("--json")
    args = parser.parse_args()
    modes = args.modes.split(",")
    unknown = [m for m in modes if split_mode(m)[0] not in MODES or any(v not in VARIANTS for v in split_mode(m)[1])
               or (split_mode(m)[1] and split_mode(m)[0] not in RINGTRAIN_MODES
                   and not (split_mode(m)[0] == TRAFFIC and split_mode(m)[1] == ["views"]))]
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {list(MODES)}, {TRAFFIC}:views, or a ringtrain mode with "
                     f"variants ({', '.join(VARIANTS)}) as after-backward:sleepy")
    if references(modes)[1:] and MPI.COMM_WORLD.Get_size() != MPI.COMM_WORLD.Split_type(
            MPI.COMM_TYPE_SHARED).Get_size():
        parser.error(f"{TRAFFIC} shares memory among the ranks: run every rank on one host")
    if args.width is None:
        args.width = 54 if args.model == "mlp" else 64
    torch.set_num_threads(1)
    hvd.init()
    comm = MPI.COMM_WORLD
    if "ddp" in modes:
        train_scaling.init_ddp(comm, torch)
    one_host = hvd.local_size() == hvd.size()
    inputs, labels = train_scaling.synthetic_batch(torch, args.model, args.width, hvd.rank(), args.batch)
    engine_cpu = engine_cpu_clock()
    clock = None
    if not args.no_phases:
        clock = PhaseClock()
        clock.install(type(state.engine().executor.transport("cpu")))
    load_before = os.getloadavg()[0]
    measured = {mode: [] for mode in modes}
    shapes = {}
    # each mode's model and optimizer are made once and keep training in every round: a fresh optimizer per round
    # would take fresh buckets from the shared window's pool, which is never given back (see empty_shared), and
    # later rounds would then measure buckets in private memory
    built = {mode: build(mode, args, comm) for mode in modes}
    for number in range(args.rounds):
        # the order alternates (ABBA...): a mode that gains or loses by its place in a round (the one before it
        # leaves the caches and the heap in some state; load from other jobs comes and goes) does so in both
        # directions
        for mode in (modes if number % 2 == 0 else modes[::-1]):
            mine = run_mode(mode, *built[mode], args, comm, inputs, labels, engine_cpu, clock)
            everyone = comm.gather(mine["stamps"], root=0)
            shapes[mode] = {"gradient_bytes": mine["gradient_bytes"], "buckets": mine["buckets"]}
            if hvd.rank() == 0:
                # free-running ranks have no common step to wait for, and DDP's synchronisation lies inside
                # backward(): neither has a stamp where the ranks meet
                measured[mode].append(phases(everyone, one_host and mode not in ("no-comm", "ddp")))
    if hvd.rank() == 0:
        report(args, modes, measured, shapes, one_host, load_before)
    for _, _, traffic in built.values():
        if traffic is not None:
            traffic.free()
    if clock is not None:
        clock.uninstall()
    if "ddp" in modes:
        torch.distributed.destroy_process_group()
    hvd.shutdown()


def summarise(modes, measured):
    summary = {}
    for mode in modes:
        summary[mode] = {}
        for phase in PHASES:
            values = [r[phase] for r in measured[mode] if r[phase] is not None]
            summary[mode][phase] = float(np.median(values)) if values else None
        walls = [r["step_wall"] for r in measured[mode]]
        summary[mode]["step_wall_range"] = [min(walls), max(walls)]
        for reference in references(modes):
            if reference in measured:
                # the reference's step over this mode's, round by round (the two a few seconds apart, so load that
                # changes between rounds cancels), and its median: a second estimate beside the ratio of the medians
                rounds = [b["step_wall"] / r["step_wall"] for b, r in zip(measured[reference], measured[mode])]
                summary[mode][f"x_{reference}_per_round"] = rounds
                summary[mode][f"x_{reference}_paired"] = float(np.median(rounds))
        rounds = [r["buckets"] for r in measured[mode] if "buckets" in r]
        if rounds:
            summary[mode]["buckets"] = {key: [float(np.median([r[key][i] for r in rounds])) for i in (0, 1)]
                                        for key in rounds[0]}
    return summary


def report(args, modes, measured, shapes, one_host, load_before):
    summary = summarise(modes, measured)
    machine = train_scaling.common.machine_info()
    any_shape = next(iter(shapes.values()))
    print(f"# ringtrain {machine['commit']}, {machine['date']}")
    print(f"# {args.model}: {any_shape['gradient_bytes'] / 2 ** 20:.1f} MB of float32 gradients, {hvd.size()} ranks, "
          f"batch {args.batch}, 1 thread per rank, transport {ringtrain.transport_name()}; ms per step, median over "
          f"{args.rounds} interleaved rounds of {args.steps} steps (each: mean over ranks of the rank's median); "
          f"load average {load_before:.2f} at start, {os.getloadavg()[0]:.2f} at end"
          + ("" if one_host else "; ranks on several hosts: no wait, after_last"))
    for mode in modes:
        if shapes[mode]["buckets"]:
            layout = ", ".join(f"{count} tensors {nbytes / 2 ** 20:.2f} MB" for count, nbytes in
                               shapes[mode]["buckets"])
            print(f"# {mode} buckets: {layout}")
    compared = references(modes)
    header = (["mode", "step", "(range)"] + [h for r in compared for h in (f"x {r}", "(paired)")]
              + ["fwd+bwd", "(cpu)", "wait", "after_last", "opt.step", "engine_cpu", "proc_cpu", "faults"])
    rows = []
    base = summary.get("lockstep")
    for mode in modes:
        s = summary[mode]
        ratios = [f for r in compared for f in
                  ((f"{summary[r]['step_wall'] / s['step_wall']:.3f}", f"{s[f'x_{r}_paired']:.3f}")
                   if r in summary else ("-", "-"))]
        rows.append([mode, _ms(s["step_wall"]), f"{s['step_wall_range'][0]:.1f}-{s['step_wall_range'][1]:.1f}"]
                    + ratios + [_ms(s["fwd_bwd"]), _ms(s["fwd_bwd_cpu"]), _ms(s["wait"]), _ms(s["after_last"]),
                                _ms(s["step"]), _ms(s["engine_cpu"]), _ms(s["proc_cpu"]), f"{s['faults']:.0f}"])
    print(train_scaling.common.format_table(header, rows))
    phase_rows = []
    for mode in modes:
        buckets = summary[mode].get("buckets")
        if not buckets:
            continue
        for thread in THREADS:
            phase_rows.append([mode, thread] + [_ms(buckets[f"{thread}.{p}"][0]) for p in BUCKET_PHASES]
                              + [_ms(sum(buckets[f"{thread}.{p}"][0] for p in BUCKET_PHASES))])
    if phase_rows:
        print(train_scaling.common.format_table(
            ["mode", "thread"] + list(BUCKET_PHASES) + ["total"], phase_rows,
            title="ringtrain's time per step by bucket phase (ms wall, exclusive, summed over buckets)"))
        for mode in modes:
            buckets = summary[mode].get("buckets")
            transport = buckets and sum(buckets[f"{t}.transport"][0] + buckets[f"{t}.slots"][0] for t in THREADS)
            if transport:
                nbytes = shapes[mode]["gradient_bytes"]
                print(f"# {mode}: {nbytes / 2 ** 20:.1f} MB of gradients allreduced per step in {transport:.2f} ms "
                      f"of transport and slots: {nbytes / transport / 1e6:.1f} GB/s (algbw)")
    for reference in compared:
        base = summary.get(reference)
        # the floors are plain torch too, but worth comparing with lockstep: what the bytes alone cost
        skipped = ("no-comm", "lockstep") if reference == "lockstep" else LOCAL_MODES
        for mode in modes:
            if base is None or split_mode(mode)[0] in skipped:
                continue
            s = summary[mode]
            parts = ", ".join(f"{name} {s[key] - base[key]:+.1f}" for name, key in
                              (("fwd+bwd", "fwd_bwd"), ("wait", "wait"), ("after_last", "after_last"),
                               ("opt.step", "step")) if s[key] is not None and base[key] is not None)
            print(f"# {mode} against {reference}: step {s['step_wall'] - base['step_wall']:+.1f} ms "
                  f"({100 * (1 - base['step_wall'] / s['step_wall']):.1f} points of {reference}'s throughput; "
                  f"{parts})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "model": args.model, "ranks": hvd.size(), "rounds": args.rounds,
                       "steps": args.steps, "load_average_start_end": [load_before, os.getloadavg()[0]],
                       "one_host": one_host, "phases_timed": not args.no_phases, "shapes": shapes,
                       "summary": summary, "per_round": measured}, f, indent=1)


def _ms(value):
    return "-" if value is None else f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"


if __name__ == "__main__":
    main()
