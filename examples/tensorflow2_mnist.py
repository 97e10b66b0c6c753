"""Horovod's TensorFlow 2 example (examples/tensorflow2/tensorflow2_mnist.py) with only the import changed.

A Keras model trained by a custom tf.function step: the tape's gradients are reduced over the ranks by
DistributedGradientTape (Average, or Adasum with --use-adasum, as Horovod's examples offer), or, with
--distributed-optimizer, by hvd.DistributedOptimizer wrapping the Keras optimizer (Horovod's TF2 form for Keras
optimizers). Variables are broadcast from rank 0 after the first step, as in Horovod's script. The data are
scikit-learn's digits (Horovod's script downloads MNIST); the learning rate scales with the ranks, as Horovod's.

    mpirun -np 2 python examples/tensorflow2_mnist.py
    mpirun -np 2 python examples/tensorflow2_mnist.py --use-adasum
    mpirun -np 2 python examples/tensorflow2_mnist.py --distributed-optimizer
"""
import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")      # TensorFlow's C++ start-up chatter, once per rank
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import ringtrain.tensorflow as hvd  # noqa: E402   (Horovod: import horovod.tensorflow as hvd)
from data import load_digits_split  # noqa: E402


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps (Horovod's: 10000 // size)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--use-adasum", action="store_true", help="reduce the gradients with Adasum")
    parser.add_argument("--distributed-optimizer", action="store_true",
                        help="wrap the Keras optimizer in hvd.DistributedOptimizer instead of the tape")
    return parser.parse_args()


def main():
    args = parse_args()
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)

    (x_train, y_train), (x_test, y_test) = load_digits_split(0.2, 0)
    dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train)).repeat().shuffle(1000, seed=hvd.rank())
    dataset = dataset.batch(args.batch_size)

    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    # Horovod: scale the learning rate by the number of workers (Adasum combines steps, so it keeps the rate)
    scale = 1 if args.use_adasum else hvd.size()
    opt = keras.optimizers.Adam(0.001 * scale)
    op = hvd.Adasum if args.use_adasum else hvd.Average
    if args.distributed_optimizer:
        opt = hvd.DistributedOptimizer(opt, op=op)

    @tf.function
    def training_step(images, labels, first_batch):
        with tf.GradientTape() as tape:
            loss_value = loss(labels, model(images, training=True))
        if not args.distributed_optimizer:
            tape = hvd.DistributedGradientTape(tape, op=op)
        grads = tape.gradient(loss_value, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        # Horovod: broadcast initial variable states from rank 0 after the first step, once the optimizer's
        # variables exist
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)
        return loss_value

    for batch, (images, labels) in enumerate(dataset.take(args.steps)):
        loss_value = training_step(images, labels, batch == 0)
        if batch % 100 == 0 and hvd.rank() == 0:
            print(f"Step #{batch}\tLoss: {float(loss_value):.6f}", flush=True)

    weights = np.concatenate([v.numpy().reshape(-1) for v in model.variables])
    spread = hvd.allreduce(tf.constant(weights), op=hvd.Max) - hvd.allreduce(tf.constant(weights), op=hvd.Min)
    accuracy = np.mean(np.argmax(model(x_test).numpy(), axis=1) == y_test)
    if hvd.rank() == 0:
        print(f"final: ranks {hvd.size()}  op {'Adasum' if args.use_adasum else 'Average'}  test accuracy {accuracy:.4f}  "
              f"largest weight difference between ranks {float(tf.reduce_max(spread)):.3g}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
