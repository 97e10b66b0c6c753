"""A JAX MLP on scikit-learn's digits, data-parallel with ringtrain.jax (plain JAX + optax, no framework).

Every rank trains on its shard of the training rows; DistributedOptimizer averages the gradients inside the jitted
step; broadcast_variables starts every rank from rank 0's parameters; the learning rate follows the linear-scaling
rule (lr * size: the averaged gradient of N shards is as noisy as one shard's of an N-times larger batch).

    python examples/jax_train.py
    mpirun -np 2 python examples/jax_train.py          # or: ringtrain-run -np 2 python examples/jax_train.py
"""
import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")   # ranks share the cores: one thread each

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import ringtrain.jax as hvd  # noqa: E402
from data import load_digits_split  # noqa: E402  (the same rows as the torch and Keras examples)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=32, help="rows per rank per step")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate on one rank (times size() here)")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--test-fraction", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def init_mlp(key, sizes):
    params = []
    for k, (fan_in, fan_out) in zip(jax.random.split(key, len(sizes) - 1), zip(sizes, sizes[1:])):
        params.append({"w": jax.random.normal(k, (fan_in, fan_out), jnp.float32) * np.sqrt(2.0 / fan_in),
                       "b": jnp.zeros(fan_out, jnp.float32)})
    return params


def logits(params, x):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def loss(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits(params, x), y).mean()


def main():
    args = parse_args()
    hvd.init()
    (x_train, y_train), (x_test, y_test) = load_digits_split(args.test_fraction, args.seed)
    x_train, y_train = x_train[hvd.rank()::hvd.size()], y_train[hvd.rank()::hvd.size()]    # this rank's shard

    # every rank draws its own initial parameters; rank 0's win
    params = init_mlp(jax.random.PRNGKey(args.seed + hvd.rank()), [x_train.shape[1], args.hidden, args.hidden, 10])
    params = hvd.broadcast_variables(params, root_rank=0)
    tx = hvd.DistributedOptimizer(optax.sgd(args.lr * hvd.size(), momentum=0.9))
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    @jax.jit
    def accuracy(params, x, y):
        return jnp.mean(jnp.argmax(logits(params, x), axis=1) == y)

    steps = len(x_train) // args.batch_size        # the same on every rank: shards differ by at most one row
    steps = int(hvd.allreduce(jnp.asarray(steps), op=hvd.Min, name="steps_per_epoch"))
    rng = np.random.default_rng(args.seed + hvd.rank())
    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        order = rng.permutation(len(x_train))
        losses = []
        for i in range(steps):
            rows = order[i * args.batch_size:(i + 1) * args.batch_size]
            params, opt_state, value = step(params, opt_state, x_train[rows], y_train[rows])
            losses.append(value)
        mean_loss = float(hvd.allreduce(jnp.mean(jnp.stack(losses)), name="epoch_loss"))
        test_accuracy = float(accuracy(params, x_test, y_test))
        if hvd.rank() == 0:
            print(f"epoch {epoch:3d}/{args.epochs}  loss {mean_loss:.4f}  test accuracy {test_accuracy:.4f}",
                  flush=True)
    elapsed = time.perf_counter() - start
    if hvd.rank() == 0:
        print(f"final: {hvd.size()} ranks, {args.epochs} epochs in {elapsed:.1f} s, "
              f"{args.epochs * steps / elapsed:.1f} steps/s, test accuracy {test_accuracy:.4f}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
