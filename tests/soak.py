"""Randomized soak of every collective against numpy, shared by tests/parallel/test_soak.py (hypothesis, short)
and the long command-line run:

    mpiexec -n 4 python tests/soak.py --soak --ops 10000      # prints "soak: ops=... wrong=..." on rank 0

A program is a list of batches; a batch is either synchronous (one call after another, some with automatic
names) or asynchronous (every op submitted with *_async in an order shuffled differently on each rank, then all
waited). Every rank draws the same program from the same choices (a seeded numpy RNG here, hypothesis's data in
the test); inputs are seeded by (seed, op, rank), so every rank can compute every other rank's input and so the
numpy reference. Values are small integers, so sums and products are exact even in float16/bfloat16 and int8;
Average is compared with a tolerance of a few ulps (the 1/N scale rounds differently from numpy's division).
"""
import argparse
import sys
import time

import numpy as np

KINDS = ("allreduce", "grouped_allreduce", "allgather", "broadcast", "alltoall", "reducescatter")
DTYPE_NAMES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64", "bool", "int16", "uint16")
OP_NAMES = ("Average", "Sum", "Min", "Max", "Product")
# element counts: empty, tiny, odd, a prime above a 4 KB segment, and above a 16 KB fusion threshold
SIZES = (0, 1, 7, 33, 1031, 4099, 9001)
NAME_POOL = [f"soak.t{i}" for i in range(24)]   # names recur across batches, with new shapes and dtypes
SOAK_CONFIG = {"fusion_threshold": 16 << 10, "segment_bytes": 4096}


class NumpyChooser:
    """Program choices from a seeded numpy RNG (identical on every rank)."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)

    def choice(self, options):
        return options[int(self.rng.integers(len(options)))]

    def integer(self, low, high):          # inclusive
        return int(self.rng.integers(low, high + 1))


# ---------------------------------------------------------------- the program
def random_op(choose, size, op_id, names_taken):
    kind = choose.choice(KINDS)
    dtype = choose.choice(DTYPE_NAMES)
    reducing = kind in ("allreduce", "grouped_allreduce", "reducescatter")
    if reducing and dtype == "bool":
        op = choose.choice(("Min", "Max"))       # Sum/Product are not defined for bool
    else:
        op = choose.choice(OP_NAMES)
    free = [n for n in NAME_POOL if n not in names_taken]
    name = choose.choice(free)
    names_taken.add(name)
    spec = {"id": op_id, "kind": kind, "dtype": dtype, "op": op, "name": name,
            "count": choose.choice(SIZES), "cols": choose.choice((1, 3)),
            "scales": (1.0, 1.0), "in_place": False}
    if kind == "allreduce" and dtype.startswith(("float", "bfloat")) and op in ("Sum", "Average"):
        spec["scales"] = (choose.choice((1.0, 0.5)), choose.choice((1.0, 2.0)))   # powers of 2: exact
    if kind == "allreduce":
        spec["in_place"] = choose.integer(0, 3) == 0
    if kind == "grouped_allreduce":
        spec["members"] = choose.integer(1, 3)
    if kind == "allgather":
        spec["first_dims"] = [choose.choice((0, 1, 2, 5, 700)) for _ in range(size)]
    if kind == "broadcast":
        spec["root"] = choose.integer(0, size - 1)
    if kind == "alltoall":
        spec["splits"] = [[choose.choice((0, 1, 3, 40)) for _ in range(size)] for _ in range(size)]
    return spec


def random_program(choose, size, n_ops):
    """Batches of 1..6 ops until n_ops ops; seed drives the per-rank shuffles and the inputs."""
    seed = choose.integer(0, 2**31 - 1)
    batches, op_id = [], 0
    while op_id < n_ops:
        asynchronous = choose.integer(0, 1) == 1
        length = min(choose.integer(1, 6), n_ops - op_id)
        taken = set()
        ops = [random_op(choose, size, op_id + i, taken) for i in range(length)]
        if not asynchronous:
            for spec in ops:      # automatic names only where the call order is the same on every rank
                if choose.integer(0, 2) == 0:
                    spec["name"] = None
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
    if spec["op"] == "Product" and spec["kind"] in ("allreduce", "grouped_allreduce", "reducescatter"):
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
        if spec.get("op") == "Average" and spec["kind"] in ("allreduce", "grouped_allreduce", "reducescatter"):
            tolerance = AVERAGE_TOLERANCE[spec["dtype"]]
            return np.allclose(got, want, rtol=tolerance, atol=tolerance)
    return np.array_equal(got, want)


# ---------------------------------------------------------------- execution
class Call:
    """One op of the program on this rank: how to submit it (sync or async) and how to check its result."""

    def __init__(self, rt, seed, spec, rank, size):
        self.rt, self.seed, self.spec, self.rank, self.size = rt, seed, spec, rank, size
        kind = spec["kind"]
        n = spec["count"]
        if kind == "allgather":
            self.inputs = [make_input(seed, spec, r, spec["first_dims"][r]) for r in range(size)]
        elif kind == "alltoall":
            self.inputs = [make_input(seed, spec, r, sum(spec["splits"][r])) for r in range(size)]
        elif kind == "grouped_allreduce":
            self.inputs = [[make_input(seed, spec, r, n + m, member=m) for r in range(size)]
                           for m in range(spec["members"])]
        else:
            self.inputs = [make_input(seed, spec, r, n) for r in range(size)]
        self.out = None

    def _args(self):
        rt, spec, r = self.rt, self.spec, self.rank
        op = getattr(rt, spec["op"])
        kind = spec["kind"]
        if kind == "allreduce":
            mine = self.inputs[r].copy()
            pre, post = spec["scales"]
            kwargs = dict(op=op, name=spec["name"], prescale_factor=pre, postscale_factor=post)
            return mine, kwargs
        if kind == "grouped_allreduce":
            return [m[r].copy() for m in self.inputs], dict(op=op, name=spec["name"])
        if kind == "allgather":
            return self.inputs[r].copy(), dict(name=spec["name"])
        if kind == "broadcast":
            return self.inputs[r].copy(), dict(root_rank=spec["root"], name=spec["name"])
        if kind == "alltoall":
            return self.inputs[r].copy(), dict(splits=list(spec["splits"][r]), name=spec["name"])
        return self.inputs[r].copy(), dict(op=op, name=spec["name"])

    def run_sync(self):
        array, kwargs = self._args()
        return getattr(self.rt, self.spec["kind"])(array, **kwargs)

    def submit_async(self):
        array, kwargs = self._args()
        if self.spec["kind"] == "allreduce" and self.spec["in_place"]:
            self.out = array
            kwargs["out"] = array
        return getattr(self.rt, self.spec["kind"] + "_async")(array, **kwargs)

    def check(self, result):
        """Number of wrong results in this op (0 or 1; a grouped op counts once) and a description."""
        spec, r, size = self.spec, self.rank, self.size
        kind = spec["kind"]
        if kind == "allreduce":
            if self.out is not None and result is not self.out and not np.shares_memory(result, self.out):
                return 1, "in-place allreduce did not return its out array"
            ok = _equal(result, reduce_reference(self.inputs, spec), spec)
        elif kind == "grouped_allreduce":
            ok = len(result) == len(self.inputs) and all(
                _equal(got, reduce_reference(m, spec), spec) for got, m in zip(result, self.inputs))
        elif kind == "allgather":
            ok = _equal(result, np.concatenate(self.inputs), spec)
        elif kind == "broadcast":
            ok = _equal(result, self.inputs[spec["root"]], spec)
        elif kind == "alltoall":
            received, received_splits = result
            blocks = []
            for j in range(size):
                start = sum(spec["splits"][j][:r])
                blocks.append(self.inputs[j][start:start + spec["splits"][j][r]])
            ok = (_equal(received, np.concatenate(blocks), spec)
                  and list(received_splits) == [spec["splits"][j][r] for j in range(size)])
        else:
            full = reduce_reference(self.inputs, spec)
            start, stop = _even_bounds(full.shape[0], size, r)
            ok = _equal(result, full[start:stop], spec)
        return (0, "") if ok else (1, f"op {spec} on rank {r}: got {result!r:.300}")


def run_program(rt, program, log=None):
    """Execute on this rank; returns (ops run, ops wrong). Errors count as wrong results and are logged."""
    rank, size = rt.rank(), rt.size()
    seed = program["seed"]
    ran = wrong = 0
    for b, batch in enumerate(program["batches"]):
        calls = [Call(rt, seed, spec, rank, size) for spec in batch["ops"]]
        results = [None] * len(calls)
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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--soak", action="store_true", help="long run (default: a short one)")
    parser.add_argument("--ops", type=int, default=None, help="operations to run (default 10000 with --soak, else 300)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chunk", type=int, default=500, help="ops per generated program")
    args = parser.parse_args(argv)
    total_ops = args.ops or (10000 if args.soak else 300)

    import ringtrain as rt
    from mpi4py import MPI
    rt.init(**SOAK_CONFIG)
    rank, size = rt.rank(), rt.size()
    start = time.perf_counter()
    ran = wrong = 0
    chunk_index = 0
    while ran < total_ops:
        choose = NumpyChooser([args.seed, chunk_index])
        program = random_program(choose, size, min(args.chunk, total_ops - ran))
        r, w = run_program(rt, program, log=lambda msg: print(msg, file=sys.stderr, flush=True) if wrong < 20 else None)
        ran += r
        wrong += w
        chunk_index += 1
    seconds = time.perf_counter() - start
    all_wrong = MPI.COMM_WORLD.allreduce(wrong, op=MPI.SUM)   # independent of ringtrain: the checker's own channel
    all_ran = MPI.COMM_WORLD.allreduce(ran, op=MPI.SUM)
    rt.shutdown()
    if rank == 0:
        print(f"soak: ranks={size} ops={ran} (per rank; {all_ran} rank-ops) wrong={all_wrong} "
              f"seconds={seconds:.1f} seed={args.seed}", flush=True)
    return 0 if all_wrong == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
