"""Gradients through ringtrain.torch's collectives on N ranks vs torch autograd on one process that builds every
rank's input (all inputs are known functions of the rank) and runs the same computation without communication.

Rank r's loss is (y_r * w_r).sum() with its own weights w_r. Horovod's rules, which these tests pin down:
allreduce/alltoall gradients are those of the SUM of the ranks' losses; allgather and broadcast ones are those of their
MEAN (Horovod averages their gradient); reducescatter's is the set's size times that of the SUM (Horovod's backward
allgathers the gradient and multiplies by the size for op=Sum, and does not divide for op=Average).
"""
import pytest
import torch

import ringtrain.torch as hvd


def x_of(rank, shape):
    return (torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float64).reshape(shape) * 0.25 + rank)


def w_of(rank, shape):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def leaf(rank, shape):
    return x_of(rank, shape).requires_grad_(True)


def everyone(shape):
    return [leaf(r, shape) for r in range(hvd.size())]


def assert_grad(got, want):
    assert got is not None
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op, pre, post", [(hvd.Sum, 1.0, 1.0), (hvd.Average, 0.5, 3.0), (hvd.Max, 1.0, 1.0)])
def test_allreduce_gradient(op, pre, post):
    n, r, shape = hvd.size(), hvd.rank(), (3, 4)
    x = leaf(r, shape)
    y = hvd.allreduce(x, op=op, prescale_factor=pre, postscale_factor=post)
    (y * w_of(r, shape)).sum().backward()
    # Horovod: the gradient is the allreduce of the gradient with the same op and scales
    weights = torch.stack([w_of(s, shape) for s in range(n)])
    if op == hvd.Max:
        want = weights.max(0).values
    else:
        want = pre * post * weights.sum(0) / (n if op == hvd.Average else 1)
    assert_grad(x.grad, want)
    if op != hvd.Max:    # ... which is the true gradient of the sum of the ranks' losses
        xs = everyone(shape)
        ys = post * sum(pre * t for t in xs) / (n if op == hvd.Average else 1)
        sum((ys * w_of(s, shape)).sum() for s in range(n)).backward()
        assert_grad(x.grad, xs[r].grad)


@pytest.mark.mpi(min_size=2)
def test_allgather_gradient_is_my_slice_of_the_average():
    n, r = hvd.size(), hvd.rank()
    x = leaf(r, (r + 1, 2))                       # uneven dim 0
    y = hvd.allgather(x)
    (y * w_of(r, y.shape)).sum().backward()
    xs = [leaf(s, (s + 1, 2)) for s in range(n)]
    full = torch.cat(xs)
    (sum((full * w_of(s, full.shape)).sum() for s in range(n)) / n).backward()
    assert_grad(x.grad, xs[r].grad)


@pytest.mark.mpi(min_size=2)
def test_broadcast_gradient_lands_on_the_root_only():
    n, r, shape, root = hvd.size(), hvd.rank(), (2, 3), hvd.size() - 1
    x = leaf(r, shape)
    y = hvd.broadcast(x, root_rank=root)
    torch.testing.assert_close(y.detach(), x_of(root, shape))
    (y * w_of(r, shape)).sum().backward()
    xs = everyone(shape)
    (sum((xs[root] * w_of(s, shape)).sum() for s in range(n)) / n).backward()
    want = xs[r].grad if xs[r].grad is not None else torch.zeros(shape, dtype=torch.float64)
    assert_grad(x.grad, want)
    assert (x.grad == 0).all() == (r != root)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("uneven", [False, True])
def test_alltoall_gradient_is_the_reverse_alltoall(uneven):
    n, r = hvd.size(), hvd.rank()

    def splits_of(s):          # rank s sends (s + j) % 3 + 1 rows to rank j, or 2 rows each when even
        return [((s + j) % 3 + 1) if uneven else 2 for j in range(n)]
    x = leaf(r, (sum(splits_of(r)), 3))
    if uneven:
        y, received = hvd.alltoall(x, splits=torch.tensor(splits_of(r), dtype=torch.int32))
        assert received.tolist() == [splits_of(s)[r] for s in range(n)] and not received.requires_grad
    else:
        y = hvd.alltoall(x)                        # Horovod: the tensor alone when splits is None
        assert isinstance(y, torch.Tensor)
    (y * w_of(r, y.shape)).sum().backward()
    xs = [leaf(s, (sum(splits_of(s)), 3)) for s in range(n)]
    blocks = [torch.split(xs[s], splits_of(s)) for s in range(n)]
    total = 0
    for dest in range(n):
        received_rows = torch.cat([blocks[s][dest] for s in range(n)])
        total = total + (received_rows * w_of(dest, received_rows.shape)).sum()
    total.backward()
    assert_grad(x.grad, xs[r].grad)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op, pre, post", [(hvd.Sum, 1.0, 1.0), (hvd.Average, 2.0, 0.25)])
def test_reducescatter_gradient_is_an_allgather(op, pre, post):
    n, r, shape = hvd.size(), hvd.rank(), (2 * hvd.size() + 1, 2)
    x = leaf(r, shape)
    y = hvd.reducescatter(x, op=op, prescale_factor=pre, postscale_factor=post)
    (y * w_of(r, y.shape)).sum().backward()
    xs = everyone(shape)
    reduced = post * sum(pre * t for t in xs) / (n if op == hvd.Average else 1)
    blocks = torch.tensor_split(reduced, n)
    torch.testing.assert_close(y.detach(), blocks[r].detach())
    sum((blocks[s] * w_of(s, blocks[s].shape)).sum() for s in range(n)).backward()
    assert_grad(x.grad, n * xs[r].grad)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op, want", [(hvd.Sum, "size"), (hvd.Average, "one")])
@pytest.mark.parametrize("grouped", [False, True])
def test_reducescatter_gradient_of_ones_as_horovod(op, want, grouped):
    """Horovod's numbers: a gradient of ones comes back as the set's size for Sum (2 with 2 ranks), as ones for
    Average."""
    n = hvd.size()
    x = torch.ones(2 * n, 3, dtype=torch.float64, requires_grad=True)
    y = (hvd.grouped_reducescatter([x], op=op)[0] if grouped else hvd.reducescatter(x, op=op))
    y.sum().backward()
    assert_grad(x.grad, torch.full_like(x, float(n) if want == "size" else 1.0))


@pytest.mark.mpi(min_size=2)
def test_grouped_forms_are_differentiable():
    n, r = hvd.size(), hvd.rank()
    a, b = leaf(r, (2, 2)), leaf(r, (3,))
    ya, yb = hvd.grouped_allreduce([a, b], op=hvd.Sum)
    ga, gb = hvd.grouped_allgather([a, b])
    sa, sb = hvd.grouped_reducescatter([a, b.view(3, 1)], op=hvd.Average)
    loss = sum((t * w_of(r + 10 * i, t.shape)).sum() for i, t in enumerate([ya, yb, ga, gb, sa, sb]))
    loss.backward()
    xa, xb = everyone((2, 2)), everyone((3,))
    ref = 0
    for s in range(n):
        outs = [sum(xa), sum(xb), torch.cat(xa), torch.cat(xb),
                torch.tensor_split(sum(xa) / n, n)[s], torch.tensor_split(sum(xb).view(3, 1) / n, n)[s]]
        scale = [1, 1, 1 / n, 1 / n, n, n]       # allgather's gradient is averaged, reducescatter's times n (Horovod)
        ref = ref + sum(c * (t * w_of(s + 10 * i, t.shape)).sum() for i, (t, c) in enumerate(zip(outs, scale)))
    ref.backward()
    assert_grad(a.grad, xa[r].grad)
    assert_grad(b.grad, xb[r].grad)
