"""Where the microseconds of one small express allreduce go, with MPI_Allreduce in the same job.

    mpiexec -n 2 python benchmarks/express_phases.py [--bytes 4096] [--calls 300] [--rounds 5] [--out file] [--quick]

Two parts, both in one job:

1. End to end: every arm -- MPI_Allreduce (mpi4py, numpy buffers, then /N), the core's numpy call
   (ringtrain.allreduce(a, name=...)) and torch in place (hvd.allreduce_(t, name=...)), each with everything
   compiled that applies (native: a recurring call while the engine is idle is one compiled call,
   engine/fast_state.py; else the express cycle's control plane in compiled code) and in Python -- runs `calls`
   calls per round, the arms
   interleaved round after round. Each figure: the median over rounds of the slowest rank's mean per call; x_mpi:
   the ratio to MPI_Allreduce in the same round. Both ranks switch between native and Python together.
2. Per phase: the same calls with perf_counter_ns stamps around each step of the path (wrappers installed on every
   rank), summed over `calls` calls; each row is one rank's mean per call, exclusive of the rows nested in it.
   The stamps cost ~0.2-0.4 us each, so the stamped total exceeds the plain one; the shares are what to read.
   Rows (Python path): describe/Meta (collectives._describe), cache lookup, slot fill + copy-in (_fill), fence +
   publish (the rest of publish: Win.Sync, the store of the cycle number), wait for the peer (gather: the
   Watchdog's poll, then Win.Sync), agreement's own logic (CycleAgreement.express minus the above), eager reduce
   (reduce_in_rank_order minus the scale), scale (ops.scale_into), engine's own logic (Engine.express minus the
   agreement and the executor), call overhead (the rest of the public call: binding, output allocation, routing).
   Native path: the native call (slot fill, fence, publish, wait for the peer, reduce, scale) replaces fill,
   publish, wait, reduce and scale; a call the compiled planned call took whole (the usual one) shows as
   "compiled planned call" alone (its own work and wait), the rest of its time as call overhead. A recurring call takes its plan from the engine's express memo
   (engine/express_memo.py): describe/Meta and the cache lookup then run only for a call's first sighting, and
   read ~0 per call.
"""
import argparse
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np                                     # noqa: E402
from mpi4py import MPI                                 # noqa: E402

from common import format_table, human_bytes, median, source_commit   # noqa: E402

PHASES = ("describe/Meta", "cache lookup", "slot fill + copy-in", "fence + publish", "wait for the peer",
          "native call", "compiled planned call", "agreement logic", "eager reduce", "scale", "engine logic", "call overhead")


class Stamps:
    """Wraps the path's steps (on this rank) to add their perf_counter_ns time to named totals."""

    def __init__(self):
        self.total = dict.fromkeys(("call", "describe", "engine", "agreement", "cache", "fill", "publish", "gather",
                                    "native", "planned", "executor", "scale"), 0)
        self.undo = []

    def wrap(self, owner, attr, key):
        original = getattr(owner, attr)
        own = attr in getattr(owner, "__dict__", {})     # an instance's own attribute (not a method): put it back
        total = self.total

        def stamped(*args, **kwargs):
            t0 = time.perf_counter_ns()
            try:
                return original(*args, **kwargs)
            finally:
                total[key] += time.perf_counter_ns() - t0
        setattr(owner, attr, stamped)
        self.undo.append((owner, attr, original, own))

    def install(self, engine):
        import ringtrain.ops as ops
        from ringtrain.core import collectives
        agreement = engine.agreement
        exchange = agreement._exchange
        self.wrap(collectives, "_describe", "describe")
        self.wrap(engine, "express", "engine")
        self.wrap(agreement, "express", "agreement")
        self.wrap(agreement.cache, "get", "cache")
        self.wrap(exchange, "_fill", "fill")
        self.wrap(exchange, "publish", "publish")
        self.wrap(exchange, "gather", "gather")
        if agreement._native is not None:     # the compiled function itself, whichever path calls it
            self.wrap(agreement._native, "_call", "native")
        self.wrap(engine.executor, "express", "executor")
        self.wrap(ops, "scale_into", "scale")
        total = self.total
        for plan in engine.memo.plans.values():     # the compiled planned call: its record's function, stamped
            record = plan.fast
            if record is not None:
                def stamped(rec, array, out, *held, real=record[0]):
                    t0 = time.perf_counter_ns()
                    try:
                        return real(rec, array, out, *held)
                    finally:
                        total["planned"] += time.perf_counter_ns() - t0
                plan.fast = (stamped,) + record[1:]
                self.undo.append((plan, "fast", record, True))

    def remove(self):
        for owner, attr, original, own in reversed(self.undo):
            if own or isinstance(owner, type(sys)):     # a module's function or an instance's own: put it back
                setattr(owner, attr, original)
            else:                                 # an instance's bound method: drop the instance attribute
                delattr(owner, attr)
        self.undo = []

    def phases(self, calls):
        """Exclusive microseconds per call, by PHASES."""
        t = {k: v / calls / 1e3 for k, v in self.total.items()}
        native = t["native"]
        return {"describe/Meta": t["describe"], "cache lookup": t["cache"], "slot fill + copy-in": t["fill"],
                "fence + publish": t["publish"] - t["fill"], "wait for the peer": t["gather"],
                "native call": native, "compiled planned call": t["planned"],
                "agreement logic": t["agreement"] - t["publish"] - t["gather"] - native - t["cache"],
                "eager reduce": t["executor"] - t["scale"], "scale": t["scale"],
                "engine logic": t["engine"] - t["agreement"] - t["executor"],
                "call overhead": t["call"] - t["engine"] - t["describe"] - t["planned"], "total": t["call"]}


def own_work(nbytes, size, calls=2000):
    """The path's own work without any wait, in this process: every peer's slot is published already (plain
    buffers laid out as the window's, see tests/test_native_cycle.py), and one rank fills, publishes and reduces --
    natively, or with the Python path's own functions. Best of 5 repeats of 2000 (the machine's noise only adds)."""
    from ringtrain.config import Config
    from ringtrain.engine import native_cycle
    from ringtrain.engine.cycle_exchange import _Exchange
    from ringtrain.ops import ReduceOp, reduce_in_rank_order, scale_into
    words, cid, n = 16, 3, nbytes // 4
    exchanges = [_Exchange(p, size, Config(), None, words, 1 << 20, lambda slot, a: slot.__setitem__(
        slice(None), a.reshape(-1))) for p in range(size)]
    published = [np.zeros(8, np.int64) for _ in range(size)]
    buffers = [(np.zeros(exchanges[0].slot_bytes, np.uint8), np.zeros(exchanges[0].slot_bytes, np.uint8))
               for _ in range(size)]
    for ex in exchanges:
        ex._slots = ex._views(buffers)
    a = np.arange(n, dtype=np.float32)
    out = np.empty_like(a)
    for p in range(1, size):
        for c in (1, 2):
            exchanges[p]._fill(c, 0, 1 << cid, 1, (cid, a))
        published[p][0] = 1 << 60
    native = native_cycle.NativeCycle.open(0, size, exchanges[0]._header_bytes, (4 + 2 * size) * 8,
                                           [x.ctypes.data for x in published],
                                           [tuple(b.ctypes.data for b in pair) for pair in buffers])
    how = native_cycle.reduce_how("float32", ReduceOp.AVERAGE, 1.0 / size, size)
    mine = exchanges[0]
    slots = [exchanges[0].eager_data(p, nbytes, np.dtype(np.float32)) for p in range(size)]
    nothing = native_cycle.library().nothing
    steps = {
        "extension call, no work (nothing())": lambda c: nothing(),
        "one array's address, as ctypes would need it": lambda c: a.__array_interface__["data"][0],
        "native call, no reduce (11 arguments)": lambda c: native.express(c, 0, cid, 1, a, out, None),
        "native call: fill, publish, check, reduce, scale": lambda c: native.express(c, 0, cid, 1, a, out, how),
        "Python: slot fill + copy-in (_fill)": lambda c: mine._fill(c, 0, 1 << cid, 1, (cid, a)),
        "Python: reduce in rank order + scale": lambda c: reduce_in_rank_order(out, slots, 0, 1.0 / size),
        "Python: scale alone (ops.scale_into)": lambda c: scale_into(out, out, 1.0 / size),
    }
    best = {}
    for label, step in steps.items():
        for _ in range(5):
            t0 = time.perf_counter()
            for c in range(1, calls + 1):
                step(c)
            us = (time.perf_counter() - t0) / calls * 1e6
            best[label] = min(best.get(label, us), us)
    native.close()
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bytes", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None, help="write the tables here too")
    parser.add_argument("--quick", action="store_true", help="20 calls, 1 round (a smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.calls, args.rounds = 20, 1

    import torch
    import ringtrain as rt
    import ringtrain.torch as hvd
    from ringtrain.core import state
    torch.set_num_threads(1)
    hvd.init()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    engine = state.engine()
    agreement = engine.agreement
    native = getattr(agreement, "_native", None)
    n = args.bytes // 4
    data = (np.arange(n) % 13 + rank).astype(np.float32)
    want = sum((np.arange(n) % 13 + r).astype(np.float64) for r in range(size)) / size
    mpi_out = np.empty_like(data)
    t = torch.from_numpy(data.copy())

    def mpi():
        comm.Allreduce(data, mpi_out, op=MPI.SUM)
        mpi_out[...] /= size
        return mpi_out

    def numpy_call():
        return rt.allreduce(data, name="phases.numpy")

    def torch_call():
        return hvd.allreduce_(t, name="phases.torch").numpy()

    arms = [("MPI_Allreduce", None, mpi)]
    for path in (("native", "python") if native is not None else ("python",)):
        arms += [(f"numpy {path}", path, numpy_call), (f"torch in place {path}", path, torch_call)]

    def use(path):
        comm.Barrier()
        engine.fast.off()                               # the compiled planned call too, or neither
        engine.fast.on = path == "native"
        agreement._native = native if path == "native" else None
        comm.Barrier()

    times, wrong = {}, {}
    for _ in range(args.rounds):
        for label, path, call in arms:
            if path is not None:
                use(path)
            t.copy_(torch.from_numpy(data))
            result = call()
            bad = int(not np.allclose(np.asarray(result, np.float64), want, rtol=1e-5))
            call()
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(args.calls):
                call()
            elapsed = (time.perf_counter() - t0) / args.calls
            times.setdefault(label, []).append(comm.allreduce(elapsed, op=MPI.MAX) * 1e6)
            wrong[label] = wrong.get(label, 0) + comm.allreduce(bad, op=MPI.SUM)

    # per phase: stamped calls, one arm at a time
    phases = {}
    for label, path, call in arms[1:]:
        use(path)
        call()
        stamps = Stamps()
        stamps.install(engine)
        comm.Barrier()
        start = time.perf_counter_ns()
        for _ in range(args.calls):
            call()
        stamps.total["call"] = time.perf_counter_ns() - start
        stamps.remove()
        phases[label] = comm.gather(stamps.phases(args.calls), root=0)
    use("native")

    own = own_work(args.bytes, size, 100 if args.quick else 2000) if rank == 0 and native is not None else None
    comm.Barrier()

    if rank == 0:
        mpi_rounds = times["MPI_Allreduce"]
        rows = []
        for label, _, _ in arms:
            values = times[label]
            ratios = [v / m for v, m in zip(values, mpi_rounds)]
            rows.append([label, f"{median(values):.1f}", f"{min(values):.1f}", f"{max(values):.1f}",
                         f"{median(ratios):.2f}", wrong[label]])
        load = os.getloadavg()
        text = format_table(["arm", "time_us", "min_us", "max_us", "x_mpi", "#wrong"], rows,
                            title=f"{human_bytes(args.bytes)} float32 Average allreduce, {size} ranks, median of "
                                  f"{args.rounds} interleaved rounds of {args.calls} calls (slowest rank's mean "
                                  f"per round); x_mpi: ratio to MPI_Allreduce in the same round")
        header = ["phase"] + [f"{label} r{r}" for label, _, _ in arms[1:] for r in range(size)]
        prows = []
        for phase in PHASES + ("total",):
            prows.append([phase] + [f"{per_rank[r][phase]:.2f}" for label, _, _ in arms[1:]
                                    for per_rank in [phases[label]] for r in range(size)])
        text += "\n\n" + format_table(header, prows,
                                      title=f"us per call by phase, each rank (stamped run of {args.calls} calls; "
                                            f"rows exclusive of one another; stamps add ~0.2-0.4 us each)")
        if own is not None:
            text += "\n\n" + format_table(["step", "us"], [[k, f"{v:.2f}"] for k, v in own.items()],
                                           title=f"one rank's own work for one {human_bytes(args.bytes)} cycle, the "
                                                 f"peers' slots already published (rank 0 alone, best of 5 repeats)")
        text += (f"\n# commit {source_commit()}; load average at the end: {load[0]:.2f} {load[1]:.2f} "
                 f"{load[2]:.2f}; native cycle {'available' if native is not None else 'NOT available'}")
        print(text, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
    hvd.shutdown()


if __name__ == "__main__":
    main()
