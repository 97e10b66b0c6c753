"""Data-parallel training with ringtrain.torch: a small MLP learns handwritten digits on every rank's shard.

A 1-hidden-layer sigmoid MLP (input-100-10), plain SGD, batch 100 per rank, 20 epochs, on scikit-learn's handwritten
digits (8x8, ships with the package) or on MNIST (`--mnist DIR` with the standard IDX files, gzipped or not). Every
rank trains on its shard and DistributedOptimizer averages the gradients; rank 0 prints and writes a checkpoint.

    python examples/train.py                          # 1 rank
    mpirun -np 2 python examples/train.py             # 2 ranks (or: ringtrain-run -np 2 python examples/train.py)
    mpirun -np 2 python examples/train.py --resume    # continue from the last epoch's checkpoint
    mpirun -np 2 python examples/train.py --lr 0.001 --no-lr-scaling --warmup-epochs 0   # the classic tutorial setting

Each rank sees batch_size rows per step, so N ranks take N times fewer steps per epoch over an N times larger global
batch: at a fixed lr that means less progress per epoch. By default the lr is multiplied by N (the linear scaling rule,
Goyal et al. 2017), ramped up linearly over `--warmup-epochs`; `--no-lr-scaling` keeps it fixed.
"""
import argparse
import os
import time

import numpy as np
import torch

import ringtrain
import ringtrain.torch as hvd
from data import load_digits_split, load_mnist


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=100, help="rows per rank per step")
    parser.add_argument("--lr", type=float, default=0.5, help="learning rate on one rank")
    parser.add_argument("--hidden", type=int, default=100)
    parser.add_argument("--lr-scaling", action=argparse.BooleanOptionalAction, default=True,
                        help="use lr * size (linear scaling rule)")
    parser.add_argument("--warmup-epochs", type=float, default=2.0,
                        help="with --lr-scaling: ramp the lr from lr to lr*size over this many epochs")
    parser.add_argument("--mnist", metavar="DIR", help="train on the MNIST IDX files in DIR instead of sklearn digits")
    parser.add_argument("--test-fraction", type=float, default=0.2, help="digits only: held-out share")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", default="train_checkpoint.pt",
                        help="rank 0 writes it atomically after every epoch ('' to disable)")
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint if it exists")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: cores // local ranks)")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    return parser.parse_args()


# ------------------------------------------------------------------------------------------------ data

def shard_batches(n_rows, epoch, seed, batch_size):
    """This rank's batches for one epoch: one shuffle shared by all ranks, rows rank::size, cut to equal length so
    every rank takes the same number of steps (no rank waits on a step the others never take)."""
    order = np.random.default_rng([seed, epoch]).permutation(n_rows)
    per_rank = n_rows // hvd.size()
    mine = order[hvd.rank()::hvd.size()][:per_rank]
    return [mine[i:i + batch_size] for i in range(0, per_rank, batch_size)]


# ------------------------------------------------------------------------------------------------ model

def make_model(inputs, hidden, classes=10):
    return torch.nn.Sequential(torch.nn.Linear(inputs, hidden), torch.nn.Sigmoid(), torch.nn.Linear(hidden, classes))


def test_accuracy(model, x, y):
    """Each rank scores a slice of the test set; one Sum allreduce adds up the counts."""
    mine = slice(hvd.rank(), None, hvd.size())
    with torch.no_grad():
        correct = (model(torch.from_numpy(x[mine])).argmax(dim=1) == torch.from_numpy(y[mine])).sum().item()
    counts = hvd.allreduce(torch.tensor([correct, len(y[mine])], dtype=torch.float64), op=hvd.Sum, name="test_acc")
    return counts[0].item() / counts[1].item()


def lr_at(step, args, steps_per_epoch):
    if not args.lr_scaling:
        return args.lr
    target = args.lr * hvd.size()
    warmup_steps = args.warmup_epochs * steps_per_epoch
    if step >= warmup_steps:
        return target
    return args.lr + (target - args.lr) * step / warmup_steps


# ------------------------------------------------------------------------------------------------ checkpoints

def save_checkpoint_atomically(path, state):
    """tmp file in the same directory + fsync + os.replace: a crash leaves the old checkpoint or the new one,
    never a torn file."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp.{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)          # make the rename itself durable
    finally:
        os.close(dir_fd)


def resume(args, model, optimizer):
    """Rank 0 reads the checkpoint; the broadcasts give every rank its model, optimizer state and epoch."""
    state = None
    if hvd.rank() == 0 and os.path.exists(args.checkpoint):
        state = torch.load(args.checkpoint, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    start_epoch = hvd.broadcast_object(state["epoch"] if state else 0, root_rank=0, name="resume_epoch")
    return start_epoch


def main():
    args = parse_args()
    hvd.init()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    # ranks sharing a node must not fight over cores
    torch.set_num_threads(args.threads or max(1, cores // hvd.local_size()))
    torch.manual_seed(args.seed)

    (x_train, y_train), (x_test, y_test) = (load_mnist(args.mnist) if args.mnist
                                            else load_digits_split(args.test_fraction, args.seed))
    model = make_model(x_train.shape[1], args.hidden)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    start_epoch = resume(args, model, optimizer) if args.resume and args.checkpoint else 0
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    steps_per_epoch = len(shard_batches(len(y_train), 0, args.seed, args.batch_size))
    if hvd.rank() == 0:
        print(f"ranks {hvd.size()}  train rows {len(y_train)}  test rows {len(y_test)}  "
              f"batch {args.batch_size}/rank  steps/epoch {steps_per_epoch}  "
              f"lr {args.lr}{' x %d (scaled)' % hvd.size() if args.lr_scaling else ''}  "
              f"transport {ringtrain.transport_name()}", flush=True)
        if start_epoch:
            print(f"resumed from {args.checkpoint} after epoch {start_epoch}", flush=True)

    x_all, y_all = torch.from_numpy(x_train), torch.from_numpy(y_train)
    total_time = 0.0
    accuracy = test_accuracy(model, x_test, y_test) if start_epoch else float("nan")
    for epoch in range(start_epoch, args.epochs):
        batches = shard_batches(len(y_train), epoch, args.seed, args.batch_size)
        progress = None
        if hvd.rank() == 0 and not args.no_progress:
            from tqdm import tqdm
            progress = tqdm(total=len(batches), desc=f"epoch {epoch + 1}/{args.epochs}", leave=False)
        start = time.perf_counter()
        loss_sum = 0.0
        for i, rows in enumerate(batches):
            lr = lr_at(epoch * steps_per_epoch + i, args, steps_per_epoch)
            for group in optimizer.param_groups:
                group["lr"] = lr
            index = torch.from_numpy(rows)
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x_all[index]), y_all[index])
            loss.backward()
            optimizer.step()
            loss_sum += loss.item()
            if progress is not None:
                progress.update(1)
                progress.set_postfix(loss=f"{loss.item():.4f}")
        elapsed = time.perf_counter() - start
        if progress is not None:
            progress.close()
        # the mean loss over ranks is the global batch's loss; the slowest rank sets the pace
        mean_loss = hvd.allreduce(torch.tensor([loss_sum / len(batches)], dtype=torch.float64), name="epoch_loss")
        epoch_time = hvd.allreduce(torch.tensor([elapsed]), op=hvd.Max, name="epoch_time").item()
        total_time += epoch_time
        accuracy = test_accuracy(model, x_test, y_test)
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1:3d}/{args.epochs}  loss {mean_loss.item():.4f}  "
                  f"test accuracy {accuracy:.4f}  time {epoch_time:.3f} s", flush=True)
            if args.checkpoint:
                save_checkpoint_atomically(args.checkpoint, {"epoch": epoch + 1, "model": model.state_dict(),
                                                             "optimizer": optimizer.state_dict()})
    if hvd.rank() == 0:
        print(f"final: ranks {hvd.size()}  epochs {args.epochs}  test accuracy {accuracy:.4f}  "
              f"train time {total_time:.2f} s", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
