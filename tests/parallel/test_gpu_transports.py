"""GPU transports with N processes sharing one GPU (cuda_ipc, mpi_staged), constructed directly and through the
engine (rt.allreduce on cupy arrays, torch CUDA tensors through DistributedOptimizer), against numpy.

Run: mpiexec -n {2,3,4} python -m pytest --with-mpi tests/parallel/test_gpu_transports.py
Skipped (with reason "no CUDA device") where no GPU works. Inputs are small integers, so results are exact.
"""
import numpy as np
import pytest

from mpi4py import MPI

from ringtrain import gpu
from ringtrain.config import Config
from ringtrain.ops import DTYPES, ReduceOp
from ringtrain.transports.base import offsets
from ringtrain.engine.watchdog import Watchdog

pytestmark = pytest.mark.skipif(not gpu.available(), reason="no CUDA device")

OPS = [ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT]
SIZES = [0, 1, 7, 1001, 100003]
DEVICE_TRANSPORTS = ["cuda_ipc", "mpi_staged"]


@pytest.fixture(scope="module")
def cp():
    import cupy
    gpu.bind(MPI.COMM_WORLD.rank)      # one GPU here: every rank binds it
    return cupy


@pytest.fixture(scope="module", params=DEVICE_TRANSPORTS)
def transport(request, cp):
    from ringtrain.transports import transport_class
    t = transport_class(request.param)(MPI.COMM_WORLD.Dup(), Config(segment_bytes=4096), Watchdog())
    yield t
    t.close()


def inputs(size, dtype_name, op, seed):
    out = []
    for r in range(MPI.COMM_WORLD.size):
        rng = np.random.default_rng([seed, r, size])
        if dtype_name == "bool":
            v = rng.integers(0, 2, size)
        elif op == ReduceOp.PRODUCT:
            v = rng.choice([1, 2] if DTYPES[dtype_name].kind == "u" else [-1, 1, 2], size)
        else:
            v = rng.integers(0, 11, size) - (0 if DTYPES[dtype_name].kind == "u" else 5)
        out.append(v.astype(DTYPES[dtype_name]))
    return out


def reference(xs, op):
    s = np.stack([x.astype(np.float64) for x in xs])
    return {ReduceOp.SUM: s.sum(0), ReduceOp.MIN: s.min(0), ReduceOp.MAX: s.max(0), ReduceOp.PRODUCT: s.prod(0)}[op]


def upload(cp, host):
    return cp.asarray(host.view(np.uint8)).view(host.dtype)


def download(array):
    gpu.comm_stream().synchronize()
    return array.view(np.uint8).get().view(array.dtype).astype(np.float64)


def pairs():
    for d in DTYPES:
        for op in OPS:
            if d != "bool" or op in (ReduceOp.MIN, ReduceOp.MAX):
                yield op, d


@pytest.mark.mpi(min_size=2)
def test_allreduce_every_op_dtype(cp, transport):
    rank = MPI.COMM_WORLD.rank
    for op, d in pairs():
        for size in SIZES if d == "float32" else SIZES[:4]:
            xs = inputs(size, d, op, 1)
            buf = upload(cp, xs[rank])
            cp.cuda.Device().synchronize()
            transport.allreduce(buf, op)
            np.testing.assert_array_equal(download(buf), reference(xs, op),
                                          err_msg=f"rank {rank} {transport.name} {op.name} {d} n={size}")


@pytest.mark.mpi(min_size=2)
def test_allreduce_in_the_staging_buffer(cp, transport):
    rank, size = MPI.COMM_WORLD.rank, 300007
    xs = inputs(size, "float32", ReduceOp.SUM, 2)
    buf = transport.staging_buffer(size * 4).view(cp.float32)
    buf[...] = cp.asarray(xs[rank])
    cp.cuda.Device().synchronize()
    transport.allreduce(buf, ReduceOp.SUM)
    np.testing.assert_array_equal(download(buf), reference(xs, ReduceOp.SUM))


@pytest.mark.mpi(min_size=2)
def test_reducescatter_allgather_broadcast_alltoall(cp, transport):
    comm = MPI.COMM_WORLD
    rank, n = comm.rank, comm.size
    size = 1000 + n
    counts = [size * r * 2 // (n * (n - 1)) for r in range(n)]
    counts[-1] += size - sum(counts)
    starts = offsets(counts)
    mine = slice(starts[rank], starts[rank] + counts[rank])
    xs = inputs(size, "int32", ReduceOp.SUM, 3)
    buf = upload(cp, xs[rank])
    cp.cuda.Device().synchronize()
    transport.reducescatter(buf, counts, ReduceOp.MAX)
    np.testing.assert_array_equal(download(buf)[mine], reference(xs, ReduceOp.MAX)[mine])

    buf = cp.zeros(size, cp.int32)
    buf[mine] = cp.asarray(xs[rank][mine])
    cp.cuda.Device().synchronize()
    transport.allgather(buf, counts)
    want = np.concatenate([xs[r][starts[r]: starts[r] + counts[r]] for r in range(n)])
    np.testing.assert_array_equal(download(buf), want)

    buf = upload(cp, xs[rank])
    cp.cuda.Device().synchronize()
    transport.broadcast(buf, n - 1)
    np.testing.assert_array_equal(download(buf), xs[n - 1])

    # rank r sends r+j+1 elements of value 100*r+j to rank j
    send_counts = [rank + j + 1 for j in range(n)]
    recv_counts = [r + rank + 1 for r in range(n)]
    send = cp.asarray(np.concatenate([np.full(c, 100 * rank + j, np.int64) for j, c in enumerate(send_counts)]))
    recv = cp.zeros(sum(recv_counts), cp.int64)
    cp.cuda.Device().synchronize()
    transport.alltoall(send, send_counts, recv, recv_counts)
    want = np.concatenate([np.full(c, 100 * r + rank, np.int64) for r, c in enumerate(recv_counts)])
    np.testing.assert_array_equal(download(recv), want)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", DEVICE_TRANSPORTS)
def test_engine_allreduce_cupy_equals_numpy(cp, name):
    import ringtrain as rt
    rt.init(transport=name)
    try:
        comm = MPI.COMM_WORLD
        xs = inputs(5003, "float32", ReduceOp.SUM, 4)
        got = rt.allreduce(cp.asarray(xs[comm.rank]), op=rt.Average)
        assert rt.transport_name("cuda") == name     # the device transport exists from the first device collective
        np.testing.assert_allclose(got.get(), reference(xs, ReduceOp.SUM) / comm.size, rtol=1e-6)
        many = [cp.full(k + 1, comm.rank + k, cp.float64) for k in range(20)]
        outs = rt.grouped_allreduce(many, op=rt.Sum)
        for k, o in enumerate(outs):
            np.testing.assert_array_equal(o.get(), np.full(k + 1, sum(range(comm.size)) + comm.size * k))
        gathered = rt.allgather(cp.full((comm.rank + 1, 2), comm.rank, cp.int32))
        want = np.concatenate([np.full((r + 1, 2), r, np.int32) for r in range(comm.size)])
        np.testing.assert_array_equal(gathered.get(), want)
        np.testing.assert_array_equal(rt.broadcast(cp.full(9, comm.rank, cp.int8), root_rank=1).get(), np.ones(9))
    finally:
        rt.shutdown()


@pytest.mark.mpi(min_size=2)
def test_torch_cuda_distributed_optimizer_equals_cpu_training(cp):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    import ringtrain.torch as hvd
    hvd.init(transport="cuda_ipc")
    try:
        comm = MPI.COMM_WORLD
        torch.manual_seed(0)
        data, target = torch.randn(8 * comm.size, 5), torch.randn(8 * comm.size, 1)
        reference_model = torch.nn.Linear(5, 1).double()
        model = torch.nn.Linear(5, 1).double().cuda()
        model.load_state_dict(reference_model.state_dict())
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
        ref_opt = torch.optim.SGD(reference_model.parameters(), lr=0.1)
        shard = slice(8 * comm.rank, 8 * (comm.rank + 1))
        for _ in range(3):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(data[shard].double().cuda()), target[shard].double().cuda()).backward()
            opt.step()
            ref_opt.zero_grad()
            torch.nn.functional.mse_loss(reference_model(data.double()), target.double()).backward()
            ref_opt.step()
        for p, q in zip(model.parameters(), reference_model.parameters()):
            np.testing.assert_allclose(p.detach().cpu().numpy(), q.detach().numpy(), rtol=1e-10, atol=1e-12)
    finally:
        hvd.shutdown()
