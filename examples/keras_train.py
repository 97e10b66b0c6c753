"""examples/train.py's experiment through Keras 3's model.fit, data-parallel with ringtrain.keras.

The same 1-hidden-layer sigmoid MLP (input-100-10), plain SGD (lr 0.5 x ranks, 2 warm-up epochs), batch 100 per rank,
20 epochs, on scikit-learn's digits (or MNIST with `--mnist DIR`). Every rank fits on its shard; DistributedOptimizer
averages the gradients inside fit; the callbacks start every rank from rank 0's weights and average the epoch metrics;
only rank 0 prints and writes the checkpoint.

    python examples/keras_train.py
    mpirun -np 2 python examples/keras_train.py
"""
import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")      # TensorFlow's C++ start-up chatter, once per rank
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import ringtrain.keras as hvd  # noqa: E402
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
    parser.add_argument("--warmup-epochs", type=int, default=2,
                        help="with --lr-scaling: ramp the lr from lr to lr*size over this many epochs")
    parser.add_argument("--mnist", metavar="DIR", help="train on the MNIST IDX files in DIR instead of sklearn digits")
    parser.add_argument("--test-fraction", type=float, default=0.2, help="digits only: held-out share")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", default="", help="rank 0 saves the model here after every epoch (.keras)")
    parser.add_argument("--threads", type=int, default=0, help="TF threads per rank (0: cores // local ranks)")
    return parser.parse_args()


def main():
    args = parse_args()
    hvd.init()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = args.threads or max(1, cores // hvd.local_size())       # ranks sharing a node must not fight
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    keras.utils.set_random_seed(args.seed + hvd.rank())               # different on purpose: the broadcast fixes it

    (x_train, y_train), (x_test, y_test) = (load_mnist(args.mnist) if args.mnist
                                            else load_digits_split(args.test_fraction, args.seed))
    # one shuffle shared by all ranks, rows rank::size, equal length so every rank takes the same number of steps
    order = np.random.default_rng(args.seed).permutation(len(y_train))
    mine = order[hvd.rank()::hvd.size()][:len(y_train) // hvd.size()]
    x_mine, y_mine = x_train[mine], y_train[mine]

    model = keras.Sequential([keras.Input((x_train.shape[1],)),
                              keras.layers.Dense(args.hidden, activation="sigmoid"),
                              keras.layers.Dense(10)])
    lr = args.lr * hvd.size() if args.lr_scaling else args.lr
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(lr)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])

    steps_per_epoch = -(-len(y_mine) // args.batch_size)
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()]
    if args.lr_scaling and args.warmup_epochs:
        callbacks.append(hvd.callbacks.LearningRateWarmupCallback(lr, args.warmup_epochs, steps_per_epoch))
    if args.checkpoint:
        callbacks += hvd.rank_zero_only(keras.callbacks.ModelCheckpoint(args.checkpoint))

    hvd.print0(f"ranks {hvd.size()}  train rows {len(y_train)}  test rows {len(y_test)}  batch "
               f"{args.batch_size}/rank  steps/epoch {steps_per_epoch}  lr {args.lr}"
               f"{' x %d (scaled)' % hvd.size() if args.lr_scaling else ''}", flush=True)
    start = time.perf_counter()
    history = model.fit(x_mine, y_mine, batch_size=args.batch_size, epochs=args.epochs, shuffle=True,
                        callbacks=callbacks, verbose=hvd.verbose(2))
    train_time = time.perf_counter() - start

    # every rank scores a slice of the test set; one Sum allreduce adds up the counts
    test = slice(hvd.rank(), None, hvd.size())
    correct = np.sum(np.argmax(model.predict(x_test[test], verbose=0), axis=1) == y_test[test])
    counts = hvd.allreduce(tf.constant([correct, len(y_test[test])], tf.float64), op=hvd.Sum, name="test_acc")
    hvd.print0(f"final: ranks {hvd.size()}  epochs {args.epochs}  train loss {history.history['loss'][-1]:.4f}  "
               f"test accuracy {float(counts[0] / counts[1]):.4f}  train time {train_time:.2f} s")
    hvd.shutdown()


if __name__ == "__main__":
    main()
