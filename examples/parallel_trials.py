"""Several hyper-parameter trials side by side in one MPI job, each data-parallel on its own process set.

    mpirun -np 4 python examples/parallel_trials.py                  # trial 0 on ranks 0,1 (lr 0.05), trial 1 on 2,3 (lr 0.5)
    mpirun -np 6 python examples/parallel_trials.py --lrs 0.01,0.1,1  # three 2-rank trials

The distributed-TensorFlow tutorials this project started from ran experiments side by side; with process sets that is
one job: the world is cut into equal consecutive groups of ranks, every group trains the same MLP on scikit-learn's
digits with its own learning rate, its own DistributedOptimizer and its own process set, so the trials' gradient
allreduces run concurrently and never wait for each other. Rank 0 prints every trial's result at the end.

--verify: each trial's first rank also trains the same model on one process over the concatenation of its ranks'
batches and reports whether the final parameters match (they should, to float rounding).
"""
import argparse

import numpy as np
import torch

import ringtrain.torch as hvd
from data import load_digits as digits_arrays   # examples/data.py


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lrs", default="0.05,0.5", help="comma-separated learning rates, one trial each")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="rows per rank per step")
    parser.add_argument("--verify", action="store_true", help="compare each trial with one-process training")
    return parser.parse_args()


def load_digits(seed=0):
    """sklearn's 1,797 8x8 digits, pixels in [0, 1], split 80/20 by a fixed permutation."""
    x, y = (torch.from_numpy(a) for a in digits_arrays())
    order = torch.tensor(np.random.default_rng(seed).permutation(len(y)))
    n_test = len(y) // 5
    return (x[order[n_test:]], y[order[n_test:]]), (x[order[:n_test]], y[order[:n_test]])


def make_model():
    torch.manual_seed(0)          # every trial starts from the same weights: only the learning rate differs
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))


def batches(x, y, batch_size, world, index):
    """Step k: rows of the global batch k (world * batch_size rows) that belong to trial rank `index`."""
    global_batch = world * batch_size
    for start in range(0, len(y) - global_batch + 1, global_batch):
        mine = slice(start + index * batch_size, start + (index + 1) * batch_size)
        yield x[mine], y[mine]


def train_distributed(trial_set, lr, train, epochs, batch_size):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), process_set=trial_set)
    hvd.broadcast_parameters(model.state_dict(), root_rank=trial_set.ranks[0], process_set=trial_set)
    for _ in range(epochs):
        for xb, yb in batches(*train, batch_size, trial_set.size(), trial_set.rank()):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(xb), yb).backward()
            optimizer.step()
    return model


def train_one_process(lr, train, epochs, batch_size, world):
    """The same steps on one process: each step's loss is the mean over the trial ranks' batches."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(epochs):
        for xb, yb in batches(*train, batch_size * world, 1, 0):
            optimizer.zero_grad()
            losses = [torch.nn.functional.cross_entropy(model(x), y)
                      for x, y in zip(xb.split(batch_size), yb.split(batch_size))]
            (sum(losses) / world).backward()
            optimizer.step()
    return model


def evaluate(model, test):
    with torch.no_grad():
        logits = model(test[0])
        return (torch.nn.functional.cross_entropy(logits, test[1]).item(),
                (logits.argmax(1) == test[1]).float().mean().item())


def main():
    args = parse_args()
    torch.set_num_threads(1)
    hvd.init()
    lrs = [float(v) for v in args.lrs.split(",")]
    if hvd.size() % len(lrs):
        raise SystemExit(f"{hvd.size()} ranks cannot be split into {len(lrs)} equal trials")
    per_trial = hvd.size() // len(lrs)
    trial_sets = [hvd.add_process_set(list(range(t * per_trial, (t + 1) * per_trial))) for t in range(len(lrs))]
    trial = hvd.rank() // per_trial
    trial_set, lr = trial_sets[trial], lrs[trial]
    train, test = load_digits()

    model = train_distributed(trial_set, lr, train, args.epochs, args.batch_size)
    loss, accuracy = evaluate(model, test)
    result = {"trial": trial, "ranks": trial_set.ranks, "lr": lr, "loss": loss, "accuracy": accuracy}
    if args.verify and trial_set.rank() == 0:
        reference = train_one_process(lr, train, args.epochs, args.batch_size, per_trial)
        result["max_abs_diff"] = max((p - q).abs().max().item()
                                     for p, q in zip(model.parameters(), reference.parameters()))
    results = hvd.allgather_object(result)       # world: rank 0 reports every trial
    if hvd.rank() == 0:
        for t in range(len(lrs)):
            mine = [r for r in results if r["trial"] == t]
            r = mine[0]      # every rank of a trial has the same parameters, hence the same numbers
            line = (f"trial {t}  ranks {r['ranks']}  lr {r['lr']:<5g}  test loss {r['loss']:.4f}  "
                    f"test accuracy {r['accuracy']:.4f}")
            diffs = [x["max_abs_diff"] for x in mine if "max_abs_diff" in x]
            if diffs:
                line += f"  max |param - one-process param| {diffs[0]:.2e}"
            print(line, flush=True)
    for s in reversed(trial_sets):
        hvd.remove_process_set(s)
    hvd.shutdown()


if __name__ == "__main__":
    main()
