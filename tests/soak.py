"""Randomized differential soak of every collective against numpy, shared by tests/parallel/test_soak.py (short,
in CI), benchmarks/soak.py (long, with ops/s and RSS) and the command line:

    mpiexec -n 4 python tests/soak.py --soak --ops 10000      # prints "soak: ops=... wrong=..." on rank 0
    mpiexec -n 4 python tests/soak.py --seed 7 --transport mpi --simulate-nodes 2 --cache-capacity 32

A program is a list of batches; a batch is either synchronous (one call after another, some with automatic
names) or asynchronous (every op submitted with *_async in an order shuffled differently on each rank, then all
waited). Every rank draws the same program from the same choices (a seeded numpy RNG here, hypothesis's data in
the test); inputs are seeded by (seed, op, rank), so every rank can compute every other rank's input and so the
numpy reference. Values are small integers, so sums and products are exact even in float16/bfloat16 and int8;
Average is compared with a tolerance of a few ulps (the 1/N scale rounds differently from numpy's division).

What a program draws: every collective kind and its grouped form, every op and dtype, sizes from 0 to past the
agreement's eager slots, the shm transport's one-barrier limit, its region (SOAK_CONFIG's fusion threshold) and
its private chunks; rank-dependent first dimensions and splits; broadcast roots that vary; names that recur and
names used once (with SOAK_CONFIG's cache capacity of 32, a program goes far past it); in-place allreduces of
arrays in the transport's shared window and of private ones; ops on a process set (the even ranks), which only
its members run; synchronous allreduces in each public form (the core call, an async call waited at once, the
torch binding in place, out of place and grouped; with --frameworks tf,jax also the TensorFlow and JAX eager
allreduce, opt-in because they import those frameworks). A failure names the seed; the same seed replays the same
program on every rank.
"""
import argparse
import sys
import time

import numpy as np

KINDS = ("allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "alltoall", "reducescatter",
         "grouped_reducescatter", "barrier")
REDUCING = ("allreduce", "grouped_allreduce", "reducescatter", "grouped_reducescatter")
GROUPED = ("grouped_allreduce", "grouped_allgather", "grouped_reducescatter")
DTYPE_NAMES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64", "bool", "int16", "uint16")
OP_NAMES = ("Average", "Sum", "Min", "Max", "Product")
# element counts: empty, tiny, odd, a prime above a 4 KB segment, and above a 16 KB fusion threshold ...
SIZES = (0, 1, 7, 33, 1031, 4099, 9001)
# ... and, drawn one time in LARGE_ODDS, past the shm one-barrier limit (64 KB), the eager slots (64 KB..1 MB) and
# a 4 MB private chunk (rows times 1 or 3 columns of up to 8 bytes)
LARGE_SIZES = (20011, 70001, 300007)
LARGE_ODDS = 12
NAME_POOL = [f"soak.t{i}" for i in range(24)]   # names recur across batches, with new shapes and dtypes
# how a synchronous allreduce is called: the core call, an async call waited at once (held back for the express
# path), or the torch binding (out of place without autograd, allreduce_ in place, or grouped_allreduce)
SYNC_FORMS = ("core", "prompt_async", "torch")
TORCH_DTYPES = ("float16", "float32", "float64", "int8", "uint8", "int32", "int64")
# --frameworks: eager allreduces of these bindings join SYNC_FORMS (JAX without x64 narrows 64-bit arrays)
FRAMEWORK_DTYPES = {"tf": ("float16", "float32", "float64", "int32", "int64"), "jax": ("float16", "float32", "int32")}
EXTRA_FORMS = ()            # main() sets it from --frameworks; empty, the draws are exactly as without it
SOAK_CONFIG = {"fusion_threshold": 16 << 10, "segment_bytes": 4096, "cache_capacity": 32}
SOAK_WINDOW_MIN_BYTES = 128 << 10  # out-of-place results in the window already at LARGE_SIZES (above the small path)
SOAK_STREAM_BYTES = 128 << 10      # ... and non-temporal result writes and copy-outs (stream_copy.py) from there too
SHARED_SCRATCH_BYTES = 4 << 20      # per rank: in-window arrays are carved from one empty_shared() block


class NumpyChooser:
    """Program choices from a seeded numpy RNG (identical on every rank)."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)

    def choice(self, options):
        return options[int(self.rng.integers(len(options)))]

    def integer(self, low, high):          # inclusive
        return int(self.rng.integers(low, high + 1))


# ---------------------------------------------------------------- the program
def set_members(size):
    """The process set a program's set ops run on: the even ranks (one rank alone at 2 ranks)."""
    return list(range(0, size, 2))


# names whose metadata never changes, so they are cached and take the fast path, the eager slots and (synchronous
# allreduces) the express path: (kind, dtype, op, rows, cols, extra fields)
STEADY = (("allreduce", "float32", "Sum", 1031, 1, {}),
          ("allreduce", "float64", "Average", 7, 3, {}),
          ("allreduce", "int32", "Max", 33, 1, {}),
          ("allreduce", "float16", "Sum", 9001, 3, {}),
          ("broadcast", "float32", "Sum", 100, 1, {}),
          ("reducescatter", "float32", "Sum", 4099, 1, {}),
          ("allreduce", "float32", "Average", 70001, 1, {"in_place": True, "shared": True}),
          ("grouped_allreduce", "float32", "Sum", 33, 1, {"tensors": 2}))


def steady_op(j, size, op_id):
    kind, dtype, op, count, cols, extra = STEADY[j]
    spec = {"id": op_id, "kind": kind, "dtype": dtype, "op": op, "name": f"soak.steady.{j}", "count": count,
            "cols": cols, "scales": (1.0, 1.0), "in_place": False, "shared": False, "group": list(range(size)),
            "in_set": False}
    spec.update(extra)
    if kind == "broadcast":
        spec["root"] = j % size
    return spec


def random_op(choose, size, op_id, names_taken, seed=0):
    if choose.integer(0, 3) == 0:                # a cached name: same metadata every time
        j = choose.integer(0, len(STEADY) - 1)
        if f"soak.steady.{j}" not in names_taken:
            names_taken.add(f"soak.steady.{j}")
            return steady_op(j, size, op_id)
    kind = choose.choice(KINDS)
    dtype = choose.choice(DTYPE_NAMES)
    reducing = kind in REDUCING
    if reducing and dtype == "bool":
        op = choose.choice(("Min", "Max"))       # Sum/Product are not defined for bool
    else:
        op = choose.choice(OP_NAMES)
    if choose.integer(0, 1):                     # a name that recurs across batches ...
        free = [n for n in NAME_POOL if n not in names_taken]
        name = choose.choice(free)
    else:                                        # ... or one used once: churn past the cache capacity
        name = f"soak.once.{seed}.{op_id}"
    names_taken.add(name)
    count = choose.choice(SIZES)
    if choose.integer(1, LARGE_ODDS) == 1 and kind in REDUCING + ("broadcast",):
        count = choose.choice(LARGE_SIZES)
    in_set = size > 2 and choose.integer(0, 5) == 0 or size == 2 and choose.integer(0, 11) == 0
    group = set_members(size) if in_set else list(range(size))
    n = len(group)
    spec = {"id": op_id, "kind": kind, "dtype": dtype, "op": op, "name": name, "count": count,
            "cols": choose.choice((1, 3)), "scales": (1.0, 1.0), "in_place": False, "shared": False,
            "group": group, "in_set": in_set}
    if kind in ("allreduce", "reducescatter", "grouped_reducescatter") and dtype.startswith(("float", "bfloat")) \
            and op in ("Sum", "Average"):
        spec["scales"] = (choose.choice((1.0, 0.5)), choose.choice((1.0, 2.0)))   # powers of 2: exact
    if kind == "allreduce":
        spec["in_place"] = choose.integer(0, 3) == 0
        spec["shared"] = spec["in_place"] and choose.integer(0, 1) == 1    # in the transport's shared window
    if kind in GROUPED:
        spec["tensors"] = choose.integer(1, 3)
    if kind in ("allgather", "grouped_allgather"):
        spec["first_dims"] = [choose.choice((0, 1, 2, 5, 700)) for _ in range(n)]
    if kind == "broadcast":
        spec["root"] = group[choose.integer(0, n - 1)]          # a world rank, as Horovod's root_rank
    if kind == "alltoall":
        spec["splits"] = [[choose.choice((0, 1, 3, 40)) for _ in range(n)] for _ in range(n)]
    return spec


def random_program(choose, size, n_ops):
    """Batches of 1..6 ops until n_ops ops; seed drives the per-rank shuffles and the inputs."""
    seed = choose.integer(0, 2**31 - 1)
    batches, op_id = [], 0
    while op_id < n_ops:
        asynchronous = choose.integer(0, 1) == 1
        length = min(choose.integer(1, 6), n_ops - op_id)
        taken = set()
        ops = [random_op(choose, size, op_id + i, taken, seed) for i in range(length)]
        if not asynchronous:
            for spec in ops:      # automatic names only where the call order is the same on every rank
                if choose.integer(0, 2) == 0:
                    spec["name"] = None
                if spec["kind"] in ("allreduce", "grouped_allreduce"):     # the public forms of a sync call
                    spec["form"] = choose.choice(SYNC_FORMS + EXTRA_FORMS)
                    if spec["form"] == "torch" and (spec["shared"] or spec["dtype"] not in TORCH_DTYPES):
                        spec["form"] = "core"
                    if spec["form"] in FRAMEWORK_DTYPES and (spec["kind"] != "allreduce" or spec["in_place"]
                                                             or spec["dtype"] not in FRAMEWORK_DTYPES[spec["form"]]):
                        spec["form"] = "core"
        batches.append({"async": asynchronous, "ops": ops})
        op_id += length
    return {"seed": seed, "batches": batches}


# ---------------------------------------------------------------- inputs and references
def _dtype(name):
    from ringtrain.ops import DTYPES
    return DTYPES[name]


def make_input(seed, spec, rank, rows, member=0):
    """Rank `rank`'s input of op `spec`: small integers chosen so that the reduction is exact in the dtype."""
    rng = np.random.default_rng([seed, spec["id"], member, rank])
    shape = (rows, spec["cols"])
    dtype = _dtype(spec["dtype"])
    if spec["dtype"] == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    if spec["op"] == "Product" and spec["kind"] in REDUCING:
        low, high = (1, 3) if spec["dtype"] in ("uint8", "uint16") else (-2, 3)    # |product| <= 2**4 over 4 ranks
    else:
        low, high = (0, 4) if spec["dtype"] in ("uint8", "uint16") else (-3, 4)
    return np.ascontiguousarray(rng.integers(low, high, shape).astype(dtype))


def reduce_reference(inputs, spec):
    dtype = inputs[0].dtype
    pre, post = spec["scales"]
    stack = np.stack([x.astype(np.float64) * pre for x in inputs])
    op = spec["op"]
    if op in ("Sum", "Average"):
        out = stack.sum(0)
    elif op == "Min":
        out = stack.min(0)
    elif op == "Max":
        out = stack.max(0)
    else:
        out = stack.prod(0)
    if op == "Average":
        if dtype.kind in "iu":
            return (np.sign(out) * (np.abs(out) // len(inputs))).astype(dtype)   # toward zero, as Horovod
        out = out / len(inputs)
    return (out * post).astype(dtype)


def _even_bounds(n, size, rank):
    base, extra = divmod(n, size)
    counts = [base + (1 if r < extra else 0) for r in range(size)]
    start = sum(counts[:rank])
    return start, start + counts[rank]


AVERAGE_TOLERANCE = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 1e-6, "float64": 1e-12}


def _equal(got, want, spec):
    got = np.asarray(got)
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if spec["dtype"] in AVERAGE_TOLERANCE:     # floats, bfloat16 included (numpy kind 'V')
        got, want = got.astype(np.float64), want.astype(np.float64)
        if spec.get("op") == "Average" and spec["kind"] in REDUCING:
            tolerance = AVERAGE_TOLERANCE[spec["dtype"]]
            return np.allclose(got, want, rtol=tolerance, atol=tolerance)
    return np.array_equal(got, want)


# ---------------------------------------------------------------- execution
class Call:
    """One op of the program on this rank: how to submit it (sync or async) and how to check its result. Ranks
    are those of the op's group (the world, or the process set): inputs, splits and blocks are indexed by them."""

    def __init__(self, rt, seed, spec, rank, size, process_set=None, scratch=None):
        self.rt, self.seed, self.spec = rt, seed, spec
        group = spec.get("group", list(range(size)))
        self.world_rank, self.rank, self.size = rank, group.index(rank), len(group)
        self.process_set = process_set if spec.get("in_set") else None
        self.scratch = scratch
        kind, n, size = spec["kind"], spec["count"], self.size
        if kind == "allgather":
            self.inputs = [make_input(seed, spec, r, spec["first_dims"][r]) for r in range(size)]
        elif kind == "grouped_allgather":
            self.inputs = [[make_input(seed, spec, r, spec["first_dims"][r] + m, member=m) for r in range(size)]
                           for m in range(spec["tensors"])]
        elif kind == "alltoall":
            self.inputs = [make_input(seed, spec, r, sum(spec["splits"][r])) for r in range(size)]
        elif kind in ("grouped_allreduce", "grouped_reducescatter"):
            self.inputs = [[make_input(seed, spec, r, n + m, member=m) for r in range(size)]
                           for m in range(spec["tensors"])]
        else:
            self.inputs = [make_input(seed, spec, r, n) for r in range(size)]
        self.out = None

    def _args(self):
        rt, spec, r = self.rt, self.spec, self.rank
        op = getattr(rt, spec["op"])
        kind = spec["kind"]
        where = {"process_set": self.process_set} if self.process_set is not None else {}
        pre, post = spec["scales"]
        if kind == "allreduce":
            return self.inputs[r].copy(), dict(op=op, name=spec["name"], prescale_factor=pre, postscale_factor=post,
                                               **where)
        if kind == "grouped_allreduce":
            return [m[r].copy() for m in self.inputs], dict(op=op, name=spec["name"], **where)
        if kind in ("allgather", "grouped_allgather"):
            array = [m[r].copy() for m in self.inputs] if kind.startswith("grouped") else self.inputs[r].copy()
            return array, dict(name=spec["name"], **where)
        if kind == "broadcast":
            return self.inputs[r].copy(), dict(root_rank=spec["root"], name=spec["name"], **where)
        if kind == "alltoall":
            return self.inputs[r].copy(), dict(splits=list(spec["splits"][r]), name=spec["name"], **where)
        if kind == "barrier":
            return None, dict(name=spec["name"], **where)
        if kind == "grouped_reducescatter":
            return [m[r].copy() for m in self.inputs], dict(op=op, name=spec["name"], prescale_factor=pre,
                                                            postscale_factor=post, **where)
        return self.inputs[r].copy(), dict(op=op, name=spec["name"], prescale_factor=pre, postscale_factor=post,
                                           **where)

    def _in_place(self, array, kwargs):
        """An in-place allreduce: of the array itself, or of a copy in the transport's shared window."""
        if self.spec["shared"] and self.scratch is not None:
            shared = self.scratch.take(array)
            if shared is not None:
                array = shared
        self.out = array
        kwargs["out"] = array
        return array

    def run_sync(self):
        array, kwargs = self._args()
        if self.spec["kind"] == "barrier":
            return self.rt.barrier(**kwargs)
        if self.spec["kind"] == "allreduce" and self.spec["in_place"]:
            array = self._in_place(array, kwargs)
        form = self.spec.get("form", "core")
        if form == "torch":
            import torch
            import ringtrain.torch as hvd
            if self.spec["kind"] == "grouped_allreduce":
                return [r.numpy() for r in hvd.grouped_allreduce([torch.from_numpy(a) for a in array], **kwargs)]
            tensor = torch.from_numpy(array)
            if kwargs.pop("out", None) is not None:
                hvd.allreduce_(tensor, **kwargs)
                return array
            return hvd.allreduce(tensor, **kwargs).numpy()
        if form == "tf":
            import tensorflow as tf
            import ringtrain.tensorflow as hvd_tf
            return hvd_tf.allreduce(tf.constant(array), **kwargs).numpy()
        if form == "jax":
            import jax.numpy as jnp
            import ringtrain.jax as hvd_jax
            return np.asarray(hvd_jax.allreduce(jnp.asarray(array), **kwargs))
        if form == "prompt_async":
            return getattr(self.rt, self.spec["kind"] + "_async")(array, **kwargs).wait()
        return getattr(self.rt, self.spec["kind"])(array, **kwargs)

    def submit_async(self):
        array, kwargs = self._args()
        if self.spec["kind"] == "barrier":      # no async barrier: a one-byte allreduce stands in, checked too
            self.inputs = [np.ones(1, np.uint8)] * self.size
            return self.rt.allreduce_async(np.ones(1, np.uint8), op=self.rt.Sum, **kwargs)
        if self.spec["kind"] == "allreduce" and self.spec["in_place"]:
            array = self._in_place(array, kwargs)
        return getattr(self.rt, self.spec["kind"] + "_async")(array, **kwargs)

    def check(self, result):
        """Number of wrong results in this op (0 or 1; a grouped op counts once) and a description."""
        spec, r, size = self.spec, self.rank, self.size
        kind = spec["kind"]
        if kind == "barrier":
            ok = result is None or np.array_equal(result, np.full(1, size, np.uint8))
        elif kind == "allreduce":
            if self.out is not None and result is not self.out and not np.shares_memory(result, self.out):
                return 1, "in-place allreduce did not return its out array"
            ok = _equal(result, reduce_reference(self.inputs, spec), spec)
        elif kind == "grouped_allreduce":
            ok = len(result) == len(self.inputs) and all(
                _equal(got, reduce_reference(m, spec), spec) for got, m in zip(result, self.inputs))
        elif kind == "allgather":
            ok = _equal(result, np.concatenate(self.inputs), spec)
        elif kind == "grouped_allgather":
            ok = len(result) == len(self.inputs) and all(
                _equal(got, np.concatenate(m), spec) for got, m in zip(result, self.inputs))
        elif kind == "broadcast":
            ok = _equal(result, self.inputs[spec.get("group", list(range(size))).index(spec["root"])], spec)
        elif kind == "alltoall":
            received, received_splits = result
            blocks = []
            for j in range(size):
                start = sum(spec["splits"][j][:r])
                blocks.append(self.inputs[j][start:start + spec["splits"][j][r]])
            ok = (_equal(received, np.concatenate(blocks), spec)
                  and list(received_splits) == [spec["splits"][j][r] for j in range(size)])
        elif kind == "grouped_reducescatter":
            ok = len(result) == len(self.inputs) and all(
                _equal(got, _block(reduce_reference(m, spec), size, r), spec) for got, m in zip(result, self.inputs))
        else:
            ok = _equal(result, _block(reduce_reference(self.inputs, spec), size, r), spec)
        return (0, "") if ok else (1, f"op {_short(spec)} on rank {self.world_rank}: got {result!r:.300}")


def _block(full, size, rank):
    start, stop = _even_bounds(full.shape[0], size, rank)
    return full[start:stop]


def _short(spec):
    return {k: v for k, v in spec.items() if k not in ("first_dims", "splits") or len(str(v)) < 80}


class SharedScratch:
    """In-window arrays for a batch, carved one after another from one empty_shared() block (the window's pool is
    never returned, so a soak must not allocate a new one per op); reset between batches."""

    def __init__(self, rt, nbytes=SHARED_SCRATCH_BYTES):
        self.block = rt.empty_shared(nbytes, np.uint8)
        self.used = 0

    def take(self, array):
        """A copy of array in the block, or None when it does not fit."""
        start = -(-self.used // 64) * 64
        if start + array.nbytes > self.block.nbytes:
            return None
        self.used = start + array.nbytes
        shared = self.block[start:start + array.nbytes].view(array.dtype).reshape(array.shape)
        shared[...] = array
        return shared

    def reset(self):
        self.used = 0


def run_program(rt, program, log=None, process_set=None, scratch=None):
    """Execute on this rank; returns (ops run, ops wrong). Errors count as wrong results and are logged. Set ops
    run on `process_set` (the even ranks; register it with set_members() first), on its members only.
    Out-of-place results come from the shm window's slots from SOAK_WINDOW_MIN_BYTES (not 4 MB), and results and
    copy-outs are streamed from SOAK_STREAM_BYTES (not 4 MB), meanwhile."""
    from ringtrain import stream_copy
    from ringtrain.engine import result_pool
    window_min, result_pool.WINDOW_MIN_BYTES = result_pool.WINDOW_MIN_BYTES, SOAK_WINDOW_MIN_BYTES
    stream_min, stream_copy.STREAM_BYTES = stream_copy.STREAM_BYTES, SOAK_STREAM_BYTES
    try:
        return _run_program(rt, program, log, process_set, scratch)
    finally:
        result_pool.WINDOW_MIN_BYTES = window_min
        stream_copy.STREAM_BYTES = stream_min


def _run_program(rt, program, log, process_set, scratch):
    rank, size = rt.rank(), rt.size()
    seed = program["seed"]
    ran = wrong = 0
    for b, batch in enumerate(program["batches"]):
        specs = [spec for spec in batch["ops"] if rank in spec.get("group", (rank,))
                 and (process_set is not None or not spec.get("in_set"))]
        calls = [Call(rt, seed, spec, rank, size, process_set, scratch) for spec in specs]
        results = [None] * len(calls)
        if scratch is not None:
            scratch.reset()
        try:
            if batch["async"]:
                order = np.random.default_rng([seed, b, rank]).permutation(len(calls))   # differs per rank
                handles = {}
                for i in order:
                    handles[i] = calls[i].submit_async()
                for i in np.random.default_rng([seed, b, rank, 1]).permutation(len(calls)):
                    results[i] = handles[i].wait()
            else:
                for i, call in enumerate(calls):
                    results[i] = call.run_sync()
        except Exception as error:     # a collective failed: every op of the batch is counted wrong
            wrong += len(calls)
            ran += len(calls)
            if log:
                log(f"rank {rank}: batch {b} raised {type(error).__name__}: {error}")
            continue
        for call, result in zip(calls, results):
            bad, why = call.check(result)
            wrong += bad
            if bad and log:
                log(why)
        ran += len(calls)
    return ran, wrong


def run_soak(rt, seed, total_ops, chunk=500, log=None):
    """Programs drawn from (seed, chunk index) until total_ops world ops; the set ops on the even ranks' process
    set. Returns (ops this rank ran, ops wrong on this rank)."""
    process_set = rt.add_process_set(set_members(rt.size())) if rt.size() > 1 else None
    scratch = SharedScratch(rt)
    ran = wrong = drawn = 0
    chunk_index = 0
    try:
        while drawn < total_ops:
            choose = NumpyChooser([seed, chunk_index])
            program = random_program(choose, rt.size(), min(chunk, total_ops - drawn))
            r, w = run_program(rt, program, log=log, process_set=process_set, scratch=scratch)
            drawn += sum(len(b["ops"]) for b in program["batches"])
            ran += r
            wrong += w
            chunk_index += 1
    finally:
        if process_set is not None:
            rt.remove_process_set(process_set)
    return ran, wrong


# ---------------------------------------------------------------- the two workloads that once broke the engine
def allgather_loop(rt, batches, prefix="loop"):
    """Per-batch predictions gathered under a new name per batch, 1..3 rows depending on the rank: one cache
    entry per (name, row count) -- past 4,096 of them every engine crashed at 4 ranks. Returns (ops, wrong)."""
    rank, size = rt.rank(), rt.size()
    want = np.ones(sum(1 + q % 3 for q in range(size)), np.float32)
    wrong = 0
    for b in range(batches):
        handles = [rt.allgather_async(np.ones(1 + rank % 3, np.float32), name=f"{prefix}.m{b}.{i}") for i in range(4)]
        for h in handles:
            wrong += not np.array_equal(h.wait(), want)
    return 4 * batches, wrong


MIX_DTYPES = ("float32", "float64", "int32", "float16")


def random_mix(rt, batches, seed, prefix="mix"):
    """Batches of 1..5 async allreduce / allgather / broadcast, four dtypes, 1 to 70,000 elements, a new name per
    op, submitted in a rank-dependent order with rank-dependent first dimensions. Returns (ops, wrong)."""
    rank, size = rt.rank(), rt.size()
    wrong = ops = 0
    for b in range(batches):
        rng = np.random.default_rng([seed, b])
        specs = []
        for i in range(int(rng.integers(1, 6))):
            kind = ("allreduce", "allgather", "broadcast")[int(rng.integers(3))]
            dtype = _dtype(MIX_DTYPES[int(rng.integers(4))])
            count = int(rng.integers(1, 70001)) if rng.random() < 0.3 else int(rng.integers(1, 300))
            specs.append((kind, dtype, count, int(rng.integers(size)), f"{prefix}.{seed}.{b}.{i}"))
        handles = {}
        for i in np.random.default_rng([seed, b, rank]).permutation(len(specs)):
            kind, dtype, count, root, name = specs[i]
            if kind == "allreduce":
                handles[i] = rt.allreduce_async(np.full(count, rank + 1, dtype), op=rt.Sum, name=name)
            elif kind == "allgather":
                handles[i] = rt.allgather_async(np.full((1 + (rank + b) % 3, 2), rank, dtype), name=name)
            else:
                handles[i] = rt.broadcast_async(np.full(count, rank, dtype), root_rank=root, name=name)
        for i, (kind, dtype, count, root, name) in enumerate(specs):
            got = handles[i].wait()
            if kind == "allreduce":
                want = np.full(count, size * (size + 1) // 2, dtype)
            elif kind == "allgather":
                want = np.concatenate([np.full((1 + (q + b) % 3, 2), q, dtype) for q in range(size)])
            else:
                want = np.full(count, root, dtype)
            wrong += not np.array_equal(got, want)
        ops += len(specs)
    return ops, wrong


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--soak", action="store_true", help="long run (default: a short one)")
    parser.add_argument("--ops", type=int, default=None, help="operations to run (default 10000 with --soak, else 300)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chunk", type=int, default=500, help="ops per generated program")
    parser.add_argument("--transport", default=None, help="RINGTRAIN_TRANSPORT for this run (shm, mpi, ...)")
    parser.add_argument("--simulate-nodes", type=int, default=0, help="split the ranks into this many pretend nodes")
    parser.add_argument("--cache-capacity", type=int, default=SOAK_CONFIG["cache_capacity"])
    parser.add_argument("--frameworks", default="", help="comma-separated: synchronous allreduces may also go "
                                                         "through these eager bindings (tf, jax)")
    args = parser.parse_args(argv)
    global EXTRA_FORMS
    EXTRA_FORMS = tuple(f for f in args.frameworks.split(",") if f)
    unknown = set(EXTRA_FORMS) - set(FRAMEWORK_DTYPES)
    if unknown:
        parser.error(f"--frameworks: unknown {sorted(unknown)} (tf, jax)")
    total_ops = args.ops or (10000 if args.soak else 300)

    import ringtrain as rt
    from mpi4py import MPI
    config = dict(SOAK_CONFIG, cache_capacity=args.cache_capacity, simulate_nodes=args.simulate_nodes)
    if args.transport:
        config["transport"] = args.transport
    rt.init(**config)
    rank, size = rt.rank(), rt.size()
    start = time.perf_counter()
    messages = []
    ran, wrong = run_soak(rt, args.seed, total_ops, args.chunk,
                          log=lambda msg: messages.append(msg) if len(messages) < 20 else None)
    seconds = time.perf_counter() - start
    for msg in messages:
        print(msg, file=sys.stderr, flush=True)
    all_wrong = MPI.COMM_WORLD.allreduce(wrong, op=MPI.SUM)   # independent of ringtrain: the checker's own channel
    all_ran = MPI.COMM_WORLD.allreduce(ran, op=MPI.SUM)
    rt.shutdown()
    if rank == 0:
        print(f"soak: ranks={size} ops={ran} (rank 0; {all_ran} rank-ops) wrong={all_wrong} "
              f"seconds={seconds:.1f} seed={args.seed}", flush=True)
        if all_wrong:
            print(f"soak FAILED; replay: mpiexec -n {size} python tests/soak.py --seed {args.seed} --ops {total_ops}"
                  f" --chunk {args.chunk} --cache-capacity {args.cache_capacity}"
                  + (f" --transport {args.transport}" if args.transport else "")
                  + (f" --simulate-nodes {args.simulate_nodes}" if args.simulate_nodes else "")
                  + (f" --frameworks {args.frameworks}" if args.frameworks else ""), flush=True)
    return 0 if all_wrong == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
