"""Elastic training with ringtrain.torch: the digits MLP of train.py, surviving workers that die and using workers
that join, with Horovod's elastic API.

    ringtrain-run -np 3 --min-np 2 python examples/elastic_train.py
    ringtrain-run -np 3 --min-np 2 python examples/elastic_train.py --demo-kill 2    # rank 2 dies in epoch 2
    ringtrain-run -np 2 --min-np 1 --max-np 4 --host-discovery-script ./discover.sh python examples/elastic_train.py

TorchState holds the model, the optimizer, the sampler and the epoch. There is no state.commit(): ringtrain's
elastic mode is lossless, so when a worker dies the survivors go on from the furthest step any of them completed
and only the step in flight is trained again (hvd.elastic.run(rollback=True) would roll back to the last commit
instead, as Horovod). ElasticSampler deals the samples not yet trained this epoch over whoever is in the world, so
after a resize no sample is trained twice or skipped. The learning rate follows the world's size (the linear
scaling rule) through a reset callback. Under plain `mpirun` the same script trains once, not elastically.
"""
import argparse
import math
import os
import signal
import time

import numpy as np
import torch

import ringtrain.torch as hvd
from data import load_digits_split


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=50, help="rows per rank per step")
    parser.add_argument("--lr", type=float, default=0.5, help="learning rate on one rank (times the world's size)")
    parser.add_argument("--demo-kill", type=int, metavar="RANK",
                        help="this rank SIGKILLs itself in the middle of epoch 2 (to watch a recovery)")
    parser.add_argument("--demo-pace", type=float, default=0.0, metavar="SECONDS",
                        help="sleep this long after each step while the world has fewer workers than it started "
                             "with (to watch a new worker come in)")
    return parser.parse_args()


def main():
    args = parse_args()
    torch.set_num_threads(1)
    hvd.init()
    started_with = hvd.size()
    torch.manual_seed(0)
    (x_train, y_train), (x_test, y_test) = load_digits_split(0.2, seed=0)
    x_train, y_train = torch.from_numpy(x_train), torch.from_numpy(y_train)
    model = torch.nn.Sequential(torch.nn.Linear(64, 100), torch.nn.Sigmoid(), torch.nn.Linear(100, 10))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size()),
                                         named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(range(len(y_train)), shuffle=True, seed=0)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0)

    def scale_lr():                     # after every change of the world
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()
        if hvd.rank() == 0:
            print(f"world of {hvd.size()} workers: epoch {state.epoch}, lr {args.lr * hvd.size():g}", flush=True)

    state.register_reset_callbacks([scale_lr])

    first_epoch = []                    # the epoch this worker first trains in: > 0 when it joined later

    @hvd.elastic.run
    def train(state):
        first_epoch[:] = first_epoch or [state.epoch]
        while state.epoch < args.epochs:
            losses = []
            for batch in range(state.sampler.steps(args.batch_size)):
                if (args.demo_kill == hvd.rank() and state.epoch == 2 and batch == 2 and hvd.size() > 1
                        and first_epoch == [0]):       # (a worker that joins in epoch 2 takes the slot, not the kill)
                    os.kill(os.getpid(), signal.SIGKILL)
                rows = state.sampler.get_indices(batch, args.batch_size)   # may be [] on a rank near the end
                optimizer.zero_grad()
                logits = model(x_train[rows])
                loss = torch.nn.functional.cross_entropy(logits, y_train[rows], reduction="sum") / args.batch_size
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
                state.sampler.record_batch(batch, args.batch_size)     # right after the step, before any collective
                if hvd.size() < started_with:
                    time.sleep(args.demo_pace)
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            accuracy = (model(torch.from_numpy(x_test)).argmax(1).numpy() == y_test).mean()
            if hvd.rank() == 0:
                print(f"epoch {state.epoch:3d}/{args.epochs}  workers {hvd.size()}  "
                      f"loss {np.mean(losses) if losses else math.nan:.4f}  test accuracy {accuracy:.4f}", flush=True)

    train(state)
    accuracy = (model(torch.from_numpy(x_test)).argmax(1).numpy() == y_test).mean()
    if hvd.rank() == 0:
        print(f"final: workers {hvd.size()}  epochs {state.epoch}  test accuracy {accuracy:.4f}", flush=True)


if __name__ == "__main__":
    main()
