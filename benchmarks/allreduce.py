"""Allreduce bandwidth and latency of ringtrain's transports against the library collectives, in one run.

    mpiexec -n 2 python benchmarks/allreduce.py --json out.json --png out.png    # about a minute on 2 cores
    mpiexec -n 2 python benchmarks/allreduce.py --full        # every dtype, 4 B..256 MB, every implementation
    mpiexec -n 2 python benchmarks/allreduce.py --quick       # float32, 4 KB..1 MB, short timings (the tests)

The default run is float32 from 4 KB to 64 MB for the public API (numpy, torch, empty_shared), the shm and mpi
transports (through the API and alone), MPI_Allreduce, torch gloo and Horovod (where installed), and the GPU
implementations where there is a GPU. Rank 0 shows a progress bar (tqdm, on stderr) whose estimate weighs each point by its expected cost.

Implementations (each skipped with a printed reason where it cannot run here):
  ringtrain-<t>      rt.allreduce(x, op=rt.Sum) through the public API with rt.init(transport=t), t in shm, mpi
                     (nccl, cuda_ipc on cupy arrays when a GPU is bound)
  ringtrain-torch-shm  ringtrain.torch.allreduce_(tensor, op=Sum): the torch binding, in place on a torch tensor
  ringtrain-shm-shared rt.allreduce(x, out=x) on an rt.empty_shared() array: the API on memory in the shm window
  ringtrain-2nodes-flat / -hierarchical  rt.allreduce with the ranks split into two pretend nodes
                     (RINGTRAIN_SIMULATE_NODES=2): the flat mpi ring vs the hierarchy (shm inside each pretend node,
                     mpi between them), with a hierarchical/flat ratio table; on 2 ranks (1+1) the hierarchy is
                     the flat ring plus its bookkeeping
  ringtrain-shm-average / -adasum  rt.allreduce(x, op=rt.Average / rt.Adasum) (not in the default run), with a
                     time ratio table against ringtrain-shm (Sum) when it ran too; Adasum is checked against a float64
                     reference of its pairwise rule (relative error 1e-5), not against the sum
  ringtrain-<t>-raw  the transport class alone: .allreduce on its already-packed staging buffer, no engine,
                     no pack/unpack, so API time minus raw time is what the engine costs
  MPI_Allreduce      mpi4py comm.Allreduce (bfloat16 through a user-defined numpy op: MPI has no bfloat16)
  torch-gloo         torch.distributed.all_reduce with the gloo backend
  horovod            horovod.torch.allreduce_(tensor, op=Sum), only where Horovod is installed (a benchmark peer,
                     never a dependency: benchmarks/build_horovod_peer.sh builds it into a venv of its own)
  nccl               ncclAllReduce through cupy, when every rank has its own GPU

Output follows nccl-tests: a table `size count dtype op time_us algbw busbw #wrong` per implementation, then ratio
tables against MPI_Allreduce. busbw = algbw * 2(N-1)/N. The machine's memcpy bandwidth is measured in the same run
and busbw is printed as a fraction of it (a shared-memory ring cannot beat memory bandwidth).
Every size is checked against a numpy reference: inputs are small integers, so every dtype's sum is exact.
"""
import argparse
import importlib.util
import os
import socket
import sys
import time

import numpy as np
from mpi4py import MPI

import common

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
# Run from a source checkout without pip install: the package sits one level up.
sys.path.append(os.path.dirname(BENCH_DIR))

PATTERN_LENGTH = 4099  # prime, so a block landing at the wrong offset shows up as #wrong


# ---------------------------------------------------------------- inputs and reference

def numpy_dtype(name):
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def rank_pattern(rank):
    """Small integers in [-3, 3]: sums over up to 85 ranks are exact even in bfloat16."""
    return np.random.default_rng(1000 + rank).integers(-3, 4, size=PATTERN_LENGTH).astype(np.float32)


def make_input(rank, count, dtype):
    return np.resize(rank_pattern(rank), count).astype(dtype)


def make_expected(size, count):
    """Sum over ranks, as float32 (exact for these integers)."""
    total = sum(rank_pattern(r) for r in range(size))
    return np.resize(total, count)


def count_wrong(result, expected):
    got = np.asarray(result).reshape(-1).astype(np.float32)
    if got.size != expected.size:
        return int(expected.size)
    return int(np.count_nonzero(got != expected))


# ---------------------------------------------------------------- timing

WARMUP_S = 0.05
WARMUP_CALLS = 10


def time_collective(run_once, comm, target_batch_s, repeats):
    """Median over `repeats` batches of back-to-back calls; a batch is long enough to amortise timer noise.
    Every rank must make the same number of calls, so the batch length is agreed from the slowest warm-up."""
    def slowest_call():
        comm.Barrier()
        start = time.perf_counter()
        run_once()
        seconds = np.array([time.perf_counter() - start])
        comm.Allreduce(MPI.IN_PLACE, seconds, op=MPI.MAX)
        return max(seconds[0], 1e-7)

    run_once()                      # first call pays setup (negotiation, buffer allocation, caches)
    # then warm up for WARMUP_S (at least WARMUP_CALLS calls, the same number on every rank): the first size of
    # the first implementation in a job otherwise also pays for cold caches and page faults of fresh buffers
    for _ in range(int(min(1000, max(WARMUP_CALLS, WARMUP_S / slowest_call())))):
        run_once()
    batch = int(min(1000, max(1, target_batch_s / slowest_call())))
    per_call = np.empty(repeats)
    for i in range(repeats):
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(batch):
            run_once()
        per_call[i] = (time.perf_counter() - start) / batch
    # A collective is as slow as its slowest rank.
    comm.Allreduce(MPI.IN_PLACE, per_call, op=MPI.MAX)
    return float(np.median(per_call)), batch * repeats


def measure_memcpy(comm, nbytes):
    """numpy copy bandwidth in GB/s (bytes copied per second): one rank alone, and all ranks at once
    (the realistic roof while every rank of a shared-memory ring copies)."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)

    def best_of(k):
        best = float("inf")
        for _ in range(k):
            start = time.perf_counter()
            np.copyto(dst, src)
            best = min(best, time.perf_counter() - start)
        return nbytes / best / 1e9

    comm.Barrier()
    solo = best_of(5) if comm.Get_rank() == 0 else 0.0
    comm.Barrier()
    concurrent = comm.allreduce(best_of(5), op=MPI.MIN)
    return comm.bcast(solo, root=0), concurrent


# ---------------------------------------------------------------- implementations

class Unavailable(Exception):
    """This implementation cannot run here; the message says why."""


class MPIAllreduce:
    name = "MPI_Allreduce"

    def __init__(self, comm):
        self.comm = comm
        self.user_ops = {}

    def start(self):
        pass

    def native(self, dtype):
        """Whether this MPI reduces dtype itself: MPICH has float16 (MPIX_C_FLOAT16), Open MPI 4 does not,
        and no MPI has bfloat16. The failure is a local datatype check, so every rank gets the same answer."""
        if dtype == numpy_dtype("bfloat16"):
            return False
        probe = np.zeros(1, dtype=dtype)
        try:
            self.comm.Allreduce(probe, np.empty_like(probe), op=MPI.SUM)
            return True
        except (MPI.Exception, KeyError, ValueError, TypeError):
            return False

    def runner(self, x, dtype_name, nbytes):
        out = np.empty_like(x)
        if x.dtype.itemsize == 2 and not self.native(x.dtype):
            # move it as 16-bit words and reduce with numpy in a user-defined op, as an MPI user would have to
            if dtype_name not in self.user_ops:
                self.user_ops[dtype_name] = MPI.Op.Create(_user_sum(x.dtype), commute=True)
            op = self.user_ops[dtype_name]
            send, recv = [x.view(np.uint16), MPI.UINT16_T], [out.view(np.uint16), MPI.UINT16_T]
        else:
            send, recv, op = x, out, MPI.SUM

        def run():
            self.comm.Allreduce(send, recv, op=op)
            return out
        return run, run

    def stop(self):
        for op in self.user_ops.values():
            op.Free()
        self.user_ops = {}


def _user_sum(dtype):
    def add_into(inbuf, outbuf, datatype):
        np.add(np.frombuffer(inbuf, dtype=dtype), np.frombuffer(outbuf, dtype=dtype),
               out=np.frombuffer(outbuf, dtype=dtype))
    return add_into


class RingtrainAPI:
    """rt.allreduce through the engine, one transport per init()."""

    def __init__(self, comm, transport, device="cpu"):
        self.comm, self.transport, self.device = comm, transport, device
        self.name = f"ringtrain-{transport}"

    def start(self):
        import ringtrain as rt
        self.rt = rt
        if self.device == "cuda":
            cupy = _require_gpu()
            if self.transport == "nccl":
                _require_gpu_per_rank(self.comm, cupy)
        try:
            rt.init(transport=self.transport)
        except Exception as exc:  # a GPU transport this machine cannot run is a skip; a host transport must work
            if rt.is_initialized():
                rt.shutdown()
            if self.device == "cpu":
                raise
            raise Unavailable(f"rt.init(transport={self.transport!r}) failed: {type(exc).__name__}: {exc}")
        # the device transport is only built at the first device collective: checked in runner()'s check
        used = rt.transport_name(device=self.device) if self.device == "cpu" else self.transport
        if used != self.transport:
            rt.shutdown()
            raise Unavailable(f"asked for transport {self.transport!r}, engine chose {used!r}")

    def runner(self, x, dtype_name, nbytes):
        rt = self.rt
        name = f"bench.{dtype_name}.{nbytes}"   # a stable name, as training would use: the engine caches it
        if self.device == "cuda":
            import cupy
            x = cupy.asarray(x)

        def run():
            return rt.allreduce(x, op=rt.Sum, name=name)

        def check():
            result = run()
            used = rt.transport_name(device=self.device)
            if used != self.transport:
                raise Unavailable(f"asked for transport {self.transport!r}, engine chose {used!r}")
            return result.get() if self.device == "cuda" else result
        return run, check

    def stop(self):
        self.rt.shutdown()


class RingtrainOp(RingtrainAPI):
    """rt.allreduce with another op than Sum on the shm transport: its #wrong compares with that op's float64
    reference (relative to the largest magnitude, 1e-5), since neither an average nor Adasum is exact here."""

    def __init__(self, comm, op):
        super().__init__(comm, "shm")
        self.op = op
        self.name = f"ringtrain-shm-{op}"

    def runner(self, x, dtype_name, nbytes):
        rt, op = self.rt, self.op
        name = f"bench.{op}.{dtype_name}.{nbytes}"

        def run():
            return rt.allreduce(x, op=op, name=name)
        return run, run

    def count_wrong(self, result, ranks, count):
        vectors = [make_input(r, count, np.float64) for r in range(ranks)]
        expected = sum(vectors) / ranks if self.op == "average" else _adasum_tree(vectors)
        error = np.abs(np.asarray(result, np.float64).reshape(-1) - expected)
        return int(np.count_nonzero(error > 1e-5 * max(np.abs(expected).max(initial=0.0), 1.0)))


def _adasum_tree(vectors):
    """Adasum's rule, (1 - a.b/2|a|^2) a + (1 - a.b/2|b|^2) b, over the ranks' halves recursively (rank order)."""
    if len(vectors) == 1:
        return vectors[0]
    a, b = _adasum_tree(vectors[:len(vectors) // 2]), _adasum_tree(vectors[len(vectors) // 2:])
    dot, aa, bb = a @ b, a @ a, b @ b
    return (1 - dot / (2 * aa) if aa else 1.0) * a + (1 - dot / (2 * bb) if bb else 1.0) * b


class RingtrainPretendNodes(RingtrainAPI):
    """rt.allreduce on two pretend nodes: what crosses the split goes over MPI only (see ringtrain/topology.py)."""

    def __init__(self, comm, hierarchical):
        super().__init__(comm, "hierarchical(shm+mpi)" if hierarchical else "mpi")    # the name the engine reports
        self.options = {"simulate_nodes": 2, "hierarchical": "1" if hierarchical else "0"}
        self.name = "ringtrain-2nodes-" + ("hierarchical" if hierarchical else "flat")

    def start(self):
        if self.comm.Get_size() < 2:
            raise Unavailable("two pretend nodes need two ranks")
        import ringtrain as rt
        self.rt = rt
        rt.init(**self.options)
        if rt.transport_name() != self.transport:
            used = rt.transport_name()
            rt.shutdown()
            raise Unavailable(f"expected transport {self.transport!r}, engine chose {used!r}")


class RingtrainTorch(RingtrainAPI):
    """ringtrain.torch.allreduce_ on a torch tensor: the binding's cost on top of the core API's."""

    def __init__(self, comm, transport):
        super().__init__(comm, transport)
        self.name = f"ringtrain-torch-{transport}"

    def runner(self, x, dtype_name, nbytes):
        import ringtrain.torch as binding
        name = f"bench.torch.{dtype_name}.{nbytes}"
        return torch_in_place_runner(x, lambda tensor: binding.allreduce_(tensor, op=binding.Sum, name=name))


class RingtrainShared(RingtrainAPI):
    """rt.allreduce in place on an rt.empty_shared() array: the public API on memory the shm transport reduces
    where it lies (what a training loop's persistent gradient bucket can be), so no copy-in and no copy-out."""

    def __init__(self, comm, transport):
        super().__init__(comm, transport)
        self.name = f"ringtrain-{transport}-shared"
        self._buffers = {}

    def runner(self, x, dtype_name, nbytes):
        rt = self.rt
        name = f"bench.shared.{dtype_name}.{nbytes}"
        buf = self._buffers.get(x.dtype)
        if buf is None or buf.size < x.size:    # one pool array per dtype, grown to the largest size seen
            buf = self._buffers[x.dtype] = rt.empty_shared(x.size, x.dtype)
        view = buf[:x.size]

        def run():
            rt.allreduce(view, op=rt.Sum, name=name, out=view)

        def check():
            view[...] = x
            run()
            result = view.copy()
            view[...] = 0           # timed calls reduce zeros: in place, anything else grows to inf (see below)
            return result
        return run, check


class RawTransport:
    """The transport class without the engine: allreduce in place on its own staging buffer."""

    def __init__(self, comm, transport):
        self.comm, self.transport = comm, transport
        self.name = f"ringtrain-{transport}-raw"

    def start(self):
        from ringtrain.config import Config
        from ringtrain.transports import transport_class
        from ringtrain.engine.watchdog import Watchdog
        cls = transport_class(self.transport)
        node = self.comm.Split_type(MPI.COMM_TYPE_SHARED)
        on_one_node = node.Get_size() == self.comm.Get_size()
        node.Free()
        if self.transport == "shm" and not on_one_node:
            raise Unavailable("shm needs every rank on one node")
        config = Config.from_env(transport=self.transport)
        pids = self.comm.allgather(os.getpid())
        me = self.comm.Get_rank()
        peers = {r: pid for r, pid in enumerate(pids) if r != me} if on_one_node else {}
        self.instance = cls(self.comm.Dup(), config, Watchdog(peers, config.peer_check_s))

    def runner(self, x, dtype_name, nbytes):
        from ringtrain.ops import ReduceOp
        buf = self.instance.staging_buffer(nbytes).view(x.dtype)

        def run():
            self.instance.allreduce(buf, ReduceOp.SUM)

        def check():
            np.copyto(buf, x)
            run()
            result = buf.copy()
            buf[...] = 0            # timed calls reduce zeros (see torch_in_place_runner)
            return result
        return run, check

    def stop(self):
        self.instance.close()


class TorchGloo:
    name = "torch-gloo"

    def __init__(self, comm):
        self.comm = comm

    def start(self):
        try:
            import torch
            import torch.distributed as dist
        except ImportError as exc:
            raise Unavailable(f"torch not installed ({exc})")
        self.torch, self.dist = torch, dist
        init_torch_distributed(self.comm, "gloo")

    def runner(self, x, dtype_name, nbytes):
        dist = self.dist
        return torch_in_place_runner(x, lambda tensor: dist.all_reduce(tensor, op=dist.ReduceOp.SUM))

    def stop(self):
        self.dist.destroy_process_group()


class HorovodTorch:
    """horovod.torch.allreduce_ (Horovod's MPI build) on a torch tensor: the peer the issue's targets name."""
    name = "horovod"

    def __init__(self, comm):
        self.comm = comm

    def start(self):
        # an external peer, never a dependency: absent is a skip, but an installed one that breaks fails loudly
        if importlib.util.find_spec("horovod") is None or importlib.util.find_spec("horovod.torch") is None:
            raise Unavailable("horovod.torch not installed (benchmarks/build_horovod_peer.sh builds it)")
        import horovod.torch as hvd
        hvd.init()
        self.hvd = hvd

    def runner(self, x, dtype_name, nbytes):
        hvd = self.hvd
        name = f"bench.{dtype_name}.{nbytes}"   # stable, so Horovod's response cache works as in training
        return torch_in_place_runner(x, lambda tensor: hvd.allreduce_(tensor, op=hvd.Sum, name=name))

    def stop(self):
        self.hvd.shutdown()


class NcclAllreduce:
    """ncclAllReduce via cupy, one GPU per rank (NCCL refuses two ranks on one GPU)."""
    name = "nccl"

    def __init__(self, comm):
        self.comm = comm

    def start(self):
        cupy = _require_gpu()
        local_rank = _require_gpu_per_rank(self.comm, cupy)
        from cupy.cuda import nccl
        cupy.cuda.Device(local_rank).use()
        uid = self.comm.bcast(nccl.get_unique_id() if self.comm.Get_rank() == 0 else None, root=0)
        self.cupy, self.nccl = cupy, nccl
        self.nccl_comm = nccl.NcclCommunicator(self.comm.Get_size(), uid, self.comm.Get_rank())
        self.stream = cupy.cuda.Stream(non_blocking=True)

    def runner(self, x, dtype_name, nbytes):
        cupy, nccl = self.cupy, self.nccl
        codes = {"float32": nccl.NCCL_FLOAT32, "float16": nccl.NCCL_FLOAT16,
                 "bfloat16": getattr(nccl, "NCCL_BFLOAT16", None)}
        if codes[dtype_name] is None:
            raise Unavailable("this cupy's NCCL binding has no bfloat16")
        source = cupy.asarray(x.view(np.uint16) if dtype_name == "bfloat16" else x)
        out = cupy.empty_like(source)

        def run():
            self.nccl_comm.allReduce(source.data.ptr, out.data.ptr, x.size, codes[dtype_name], nccl.NCCL_SUM,
                                     self.stream.ptr)
            self.stream.synchronize()

        def check():
            run()
            host = out.get()
            return host.view(x.dtype)
        return run, check

    def stop(self):
        self.nccl_comm.destroy()


def _require_gpu_per_rank(comm, cupy):
    """This rank's local rank, if every rank of the node can have its own GPU (NCCL refuses to share one)."""
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local_rank, local_size = local.Get_rank(), local.Get_size()
    local.Free()
    if cupy.cuda.runtime.getDeviceCount() < local_size:
        raise Unavailable(f"{local_size} ranks on this node but only {cupy.cuda.runtime.getDeviceCount()} "
                          f"GPU(s); NCCL needs one GPU per rank")
    return local_rank


def _require_gpu():
    """cupy with at least one usable device, else Unavailable (cupy imports fine on GPU-less machines)."""
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise Unavailable("no GPU")
        return cupy
    except Unavailable:
        raise
    except Exception as exc:
        raise Unavailable(f"no usable GPU ({type(exc).__name__}: {exc})")


def torch_in_place_runner(x, allreduce_in_place):
    """(run, check) for an in-place allreduce of a torch copy of x. The timed calls reduce zeros: summing a result
    into itself again and again overflows to inf, and numpy's overflow warning on every call would then be timed
    too (ringtrain's reductions are numpy ufuncs; Horovod's are C++ and would not pay it)."""
    source = numpy_to_torch(x)
    tensor = source.clone()

    def run():
        allreduce_in_place(tensor)

    def check():
        tensor.copy_(source)
        run()
        result = torch_to_numpy(tensor).copy()
        tensor.zero_()
        return result
    return run, check


def numpy_to_torch(x):
    import torch
    if x.dtype == numpy_dtype("bfloat16"):
        return torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(x.copy())


def torch_to_numpy(tensor):
    import torch
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(numpy_dtype("bfloat16"))
    return tensor.numpy()


def init_torch_distributed(comm, backend):
    """torch.distributed through env:// with an address and free port chosen by rank 0 and shared over MPI."""
    import torch.distributed as dist
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    one_node = node.Get_size() == comm.Get_size()
    node.Free()
    address = None
    if comm.Get_rank() == 0:
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        address = ("127.0.0.1" if one_node else socket.gethostname(), port)
    host, port = comm.bcast(address, root=0)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = host, str(port)
    dist.init_process_group(backend, init_method="env://", rank=comm.Get_rank(), world_size=comm.Get_size())


# ---------------------------------------------------------------- driver

def build_impls(comm, names):
    impls = [
        RingtrainAPI(comm, "shm"), RingtrainTorch(comm, "shm"), RingtrainShared(comm, "shm"),
        RawTransport(comm, "shm"), RingtrainOp(comm, "average"), RingtrainOp(comm, "adasum"),
        RingtrainAPI(comm, "mpi"), RawTransport(comm, "mpi"),
        RingtrainPretendNodes(comm, hierarchical=False), RingtrainPretendNodes(comm, hierarchical=True),
        MPIAllreduce(comm), TorchGloo(comm), HorovodTorch(comm),
        RingtrainAPI(comm, "cuda_ipc", device="cuda"), RingtrainAPI(comm, "nccl", device="cuda"),
        NcclAllreduce(comm),
    ]
    if names:
        wanted = set(names.split(","))
        unknown = wanted - {i.name for i in impls}
        if unknown:
            raise ValueError(f"--impls names unknown implementations {sorted(unknown)}; "
                             f"known: {[i.name for i in impls]}")
        impls = [i for i in impls if i.name in wanted]
    return impls


def agree(comm, ok):
    """True only if every rank says ok: a skip on one rank must be a skip on all, or the next call hangs."""
    return comm.allreduce(bool(ok), op=MPI.LAND)


def run_impl(impl, comm, sizes, dtypes, args, log, progress):
    records, rank, ranks = [], comm.Get_rank(), comm.Get_size()
    reason = failure = None
    try:
        impl.start()
    except Unavailable as exc:
        reason = str(exc)
    except Exception as exc:  # broken, not unavailable: every rank stops with it (one rank alone would hang the rest)
        failure = f"rank {rank}: {type(exc).__name__}: {exc}"
    failures = [f for f in comm.allgather(failure) if f]
    if failures:
        raise RuntimeError(f"{impl.name} failed to start: {failures[0]}")
    if not agree(comm, reason is None):
        reasons = [r for r in comm.allgather(reason) if r]
        log(f"# {impl.name}: skipped ({reasons[0]})")
        if reason is None:
            impl.stop()
        progress.advance(sum(expected_seconds(n, args) for n in sizes) * len(dtypes), f"{impl.name} skipped")
        return records, f"skipped: {reasons[0]}"
    note = "ok"
    for dtype_name in dtypes:
        dtype = numpy_dtype(dtype_name)
        for nbytes in sizes:
            count = max(1, nbytes // dtype.itemsize)
            x = make_input(rank, count, dtype)
            problem = result = None
            try:
                run, check = impl.runner(x, dtype_name, count * dtype.itemsize)
                result = check()
            except Unavailable as exc:
                problem = str(exc)
            if not agree(comm, problem is None):
                log(f"# {impl.name} {dtype_name}: skipped ({problem or 'another rank could not run it'})")
                progress.advance(sum(expected_seconds(n, args) for n in sizes if n >= nbytes), f"{impl.name} skipped")
                break
            wrong = (impl.count_wrong(result, ranks, count) if hasattr(impl, "count_wrong")
                     else count_wrong(result, make_expected(ranks, count)))
            wrong = comm.allreduce(wrong, op=MPI.SUM)
            seconds, calls = time_collective(run, comm, args.batch_seconds, args.repeats)
            algbw = count * dtype.itemsize / seconds / 1e9
            records.append({"impl": impl.name, "ranks": ranks, "bytes": count * dtype.itemsize, "count": count,
                            "dtype": dtype_name, "op": getattr(impl, "op", "sum"), "time_us": seconds * 1e6, "algbw_gbps": algbw,
                            "busbw_gbps": common.bus_bandwidth(algbw, ranks), "wrong": wrong, "calls": calls})
            if wrong:
                note = "WRONG RESULTS"
            progress.advance(expected_seconds(nbytes, args), f"{impl.name} {dtype_name} {common.human_bytes(nbytes)}")
    impl.stop()
    return records, note


# What each run covers unless flags say otherwise: dtypes, min and max bytes, timed batches per size, seconds per batch,
# and the implementations ("" = all). The default measures what the docs' tables quote, in about a minute on 2 cores.
DEFAULT_IMPLS = ("ringtrain-shm,ringtrain-torch-shm,ringtrain-shm-shared,ringtrain-shm-raw,ringtrain-mpi,ringtrain-mpi-raw,"
                 "MPI_Allreduce,torch-gloo,horovod,ringtrain-cuda_ipc,ringtrain-nccl,nccl")
RUN_SETTINGS = {
    "quick": ("float32", 4096, 1 << 20, 3, 0.005, ""),
    "default": ("float32", 4096, 64 << 20, 9, 0.04, DEFAULT_IMPLS),
    "full": ("float32,float16,bfloat16", 4, 256 << 20, 7, 0.03, ""),
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--png", help="plot busbw vs size here")
    run = parser.add_mutually_exclusive_group()
    run.add_argument("--quick", action="store_true", help="float32, 4 KB..1 MB, short timings (< 1 minute)")
    run.add_argument("--full", action="store_true",
                     help="every dtype (float32, float16, bfloat16), 4 B..256 MB, every implementation (~20 minutes)")
    parser.add_argument("--impls", default=None, help="comma-separated subset of implementation names")
    parser.add_argument("--dtypes", default=None, help="comma-separated dtypes (default float32)")
    parser.add_argument("--min-bytes", type=int, default=None)
    parser.add_argument("--max-bytes", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None, help="timed batches per size (median reported)")
    parser.add_argument("--batch-seconds", type=float, default=None, help="target length of one timed batch")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    dtypes, min_bytes, max_bytes, repeats, batch_seconds, impls = RUN_SETTINGS[
        "quick" if args.quick else "full" if args.full else "default"]
    args.dtypes = (args.dtypes or dtypes).split(",")
    args.min_bytes = args.min_bytes or min_bytes
    args.max_bytes = args.max_bytes or max_bytes
    args.repeats = args.repeats or repeats
    args.batch_seconds = args.batch_seconds or batch_seconds
    args.impls = impls if args.impls is None else args.impls
    return args


def expected_seconds(nbytes, args):
    """A rough cost of measuring one size: the timed batches, plus warm-up and checking calls that each move the
    buffer at about 1 GB/s (the slower peers' speed here). Only the progress bar's estimate uses it."""
    calls = WARMUP_CALLS + args.repeats + 2
    return 0.05 + WARMUP_S + args.repeats * args.batch_seconds + calls * nbytes / 1e9


class Progress:
    """tqdm on rank 0 counting expected seconds, so its estimate of the time left is not fooled by the cheap small
    sizes coming first; a no-op elsewhere or with --no-progress."""

    def __init__(self, enabled, total_seconds):
        self.bar = None
        if enabled:
            from tqdm import tqdm
            self.bar = tqdm(total=total_seconds, desc="allreduce benchmark", file=sys.stderr,
                            bar_format="{l_bar}{bar}| [{elapsed}<{remaining}] {postfix}")

    def advance(self, seconds, where):
        if self.bar is not None:
            self.bar.set_postfix_str(where, refresh=False)
            self.bar.update(min(seconds, self.bar.total - self.bar.n))     # float sums may overshoot the total

    def close(self):
        if self.bar is not None:
            self.bar.close()


def main(argv=None):
    args = parse_args(argv)
    comm = MPI.COMM_WORLD
    rank, ranks = comm.Get_rank(), comm.Get_size()

    def log(text):
        if rank == 0:
            print(text, flush=True)

    sizes = common.size_ladder(args.min_bytes, args.max_bytes, 4)
    memcpy_solo, memcpy_all = measure_memcpy(comm, (64 << 20) if args.quick else (256 << 20))
    log(f"# ringtrain allreduce benchmark: {ranks} ranks, {os.cpu_count()} cores, dtypes {args.dtypes}, "
        f"{common.human_bytes(sizes[0])}..{common.human_bytes(sizes[-1])}, commit {common.source_commit()}")
    log(f"# numpy memcpy bandwidth: {memcpy_solo:.2f} GB/s one rank alone, {memcpy_all:.2f} GB/s per rank "
        f"with all {ranks} copying (the roof used for of_memcpy)")

    records, notes = [], {}
    impls = build_impls(comm, args.impls)
    planned = len(impls) * len(args.dtypes) * sum(expected_seconds(n, args) for n in sizes)
    log(f"# {len(impls)} implementations x {len(args.dtypes)} dtypes x {len(sizes)} sizes: at most about "
        f"{planned / 60:.1f} minutes, less where implementations skip (--full: the whole sweep)")
    progress = Progress(rank == 0 and not args.no_progress, planned)
    for impl in impls:
        impl_records, notes[impl.name] = run_impl(impl, comm, sizes, args.dtypes, args, log, progress)
        for r in impl_records:
            r["memcpy_gbps"] = memcpy_all
        records += impl_records
        if impl_records:
            log("")
            log(common.allreduce_table(records, impl.name, roof_gbps=memcpy_all))

    progress.close()
    if rank == 0:
        if any(r["impl"] == "MPI_Allreduce" for r in records):
            print()
            print(common.ratio_table(records, "MPI_Allreduce", "busbw_gbps"))
            print()
            print(common.ratio_table(records, "MPI_Allreduce", "time_us").replace(
                "time_us ratio", "time ratio (>1 = slower than MPI_Allreduce),"))
        by_op = [r for r in records if r["impl"] in ("ringtrain-shm", "ringtrain-shm-average", "ringtrain-shm-adasum")]
        if len({r["impl"] for r in by_op}) > 1 and any(r["impl"] == "ringtrain-shm" for r in by_op):
            print()
            print(common.ratio_table(by_op, "ringtrain-shm", "time_us").replace(
                "time_us ratio", "time ratio (>1 = slower than Sum),"))
        split = [r for r in records if r["impl"].startswith("ringtrain-2nodes-")]
        if {r["impl"] for r in split} == {"ringtrain-2nodes-flat", "ringtrain-2nodes-hierarchical"}:
            print()
            print(common.ratio_table(split, "ringtrain-2nodes-flat", "busbw_gbps"))
        total_wrong = sum(r["wrong"] for r in records)
        print(f"\n# total #wrong: {total_wrong}; implementations: " +
              ", ".join(f"{k} ({v})" for k, v in notes.items()))
        if args.json:
            stamp = common.machine_info()
            for r in records:
                r["date"] = stamp["date"]
                r["cores"] = stamp["cores"]
                r["commit"] = stamp["commit"]
            common.write_json(args.json, records)
        if args.png and records:
            common.plot_busbw(records, args.png, f"allreduce busbw, {ranks} ranks, {os.cpu_count()} cores "
                                                 f"(memcpy {memcpy_all:.1f} GB/s)")
    failed = comm.bcast(any(r["wrong"] for r in records) if rank == 0 else None, root=0)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
