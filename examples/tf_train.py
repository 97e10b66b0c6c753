"""examples/train.py's experiment as a custom TensorFlow 2 training loop: DistributedGradientTape inside tf.function.

The same 1-hidden-layer sigmoid MLP (input-100-10), plain SGD (lr 0.5 x ranks, 2 warm-up epochs), batch 100 per rank,
20 epochs, on scikit-learn's digits (or MNIST with `--mnist DIR`). Each step is one tf.function: forward, tape,
gradients averaged over all ranks (one host call per step into ringtrain's engine), SGD update.

    python examples/tf_train.py
    mpirun -np 2 python examples/tf_train.py
"""
import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")      # TensorFlow's C++ start-up chatter, once per rank

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import ringtrain.tensorflow as hvd  # noqa: E402
from data import load_digits_split, load_mnist  # noqa: E402  (the same rows as examples/train.py)


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
    parser.add_argument("--threads", type=int, default=0, help="TF threads per rank (0: cores // local ranks)")
    return parser.parse_args()


class MLP(tf.Module):
    def __init__(self, inputs, hidden, classes=10, seed=0):
        super().__init__()
        init = tf.keras.initializers.GlorotUniform(seed=seed)
        self.w1 = tf.Variable(init((inputs, hidden)), name="w1")
        self.b1 = tf.Variable(tf.zeros([hidden]), name="b1")
        self.w2 = tf.Variable(init((hidden, classes)), name="w2")
        self.b2 = tf.Variable(tf.zeros([classes]), name="b2")

    def __call__(self, x):
        return tf.matmul(tf.sigmoid(tf.matmul(x, self.w1) + self.b1), self.w2) + self.b2


def lr_at(step, args, steps_per_epoch):
    if not args.lr_scaling:
        return args.lr
    target = args.lr * hvd.size()
    warmup_steps = args.warmup_epochs * steps_per_epoch
    if step >= warmup_steps:
        return target
    return args.lr + (target - args.lr) * step / warmup_steps


def main():
    args = parse_args()
    hvd.init()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    tf.config.threading.set_intra_op_parallelism_threads(args.threads or max(1, cores // hvd.local_size()))

    (x_train, y_train), (x_test, y_test) = (load_mnist(args.mnist) if args.mnist
                                            else load_digits_split(args.test_fraction, args.seed))
    model = MLP(x_train.shape[1], args.hidden, seed=args.seed + hvd.rank())   # differs by rank on purpose
    hvd.broadcast_variables(model.trainable_variables, root_rank=0)           # ... and now it does not
    learning_rate = tf.Variable(args.lr, dtype=tf.float32, trainable=False)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        for variable, grad in zip(model.trainable_variables, grads):
            variable.assign_sub(learning_rate * grad)
        return loss

    per_rank = len(y_train) // hvd.size()
    steps_per_epoch = -(-per_rank // args.batch_size)
    if hvd.rank() == 0:
        print(f"ranks {hvd.size()}  train rows {len(y_train)}  test rows {len(y_test)}  batch "
              f"{args.batch_size}/rank  steps/epoch {steps_per_epoch}  lr {args.lr}"
              f"{' x %d (scaled)' % hvd.size() if args.lr_scaling else ''}", flush=True)
    total_time = 0.0
    for epoch in range(args.epochs):
        # one shuffle shared by all ranks, rows rank::size, equal length: every rank takes the same number of steps
        order = np.random.default_rng([args.seed, epoch]).permutation(len(y_train))
        mine = order[hvd.rank()::hvd.size()][:per_rank]
        start = time.perf_counter()
        losses = []
        for i in range(steps_per_epoch):
            rows = mine[i * args.batch_size:(i + 1) * args.batch_size]
            learning_rate.assign(lr_at(epoch * steps_per_epoch + i, args, steps_per_epoch))
            losses.append(train_step(tf.constant(x_train[rows]), tf.constant(y_train[rows])))
        loss = hvd.allreduce(tf.reduce_mean(tf.stack(losses)), name="epoch_loss")    # mean over ranks
        elapsed = time.perf_counter() - start
        total_time += elapsed
        test = slice(hvd.rank(), None, hvd.size())
        correct = np.sum(np.argmax(model(tf.constant(x_test[test])).numpy(), axis=1) == y_test[test])
        counts = hvd.allreduce(tf.constant([correct, len(y_test[test])], tf.float64), op=hvd.Sum, name="test_acc")
        accuracy = float(counts[0] / counts[1])
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1:3d}/{args.epochs}  loss {float(loss):.4f}  test accuracy {accuracy:.4f}  "
                  f"time {elapsed:.3f} s", flush=True)
    if hvd.rank() == 0:
        print(f"final: ranks {hvd.size()}  epochs {args.epochs}  test accuracy {accuracy:.4f}  "
              f"train time {total_time:.2f} s")
    hvd.shutdown()


if __name__ == "__main__":
    main()
