"""Elastic training with Keras 3 `model.fit` and ringtrain.keras: the digits MLP, surviving workers that die and
using workers that join, with Horovod's elastic API and callbacks.

    ringtrain-run -np 3 --min-np 2 python examples/keras_elastic_train.py
    ringtrain-run -np 3 --min-np 2 python examples/keras_elastic_train.py --demo-kill 2    # rank 2 dies in epoch 2

KerasState holds the model and optimizer variables and the epoch. Recovery is lossless (ringtrain's default): when
a worker dies, the survivors go on from the furthest batch any of them completed (the optimizer's step count
tells), so only the batch in flight is trained again. CommitStateCallback copies nothing then: every few batches it
is where the ranks agree whether workers joined. UpdateEpochStateCallback keeps state.epoch, so
fit(initial_epoch=state.epoch) resumes in the right epoch; the ElasticSampler's record is kept in the state as a
plain attribute, updated right after each batch. The learning rate follows the world's size.
"""
import argparse
import os
import signal
import time

import keras
import numpy as np
import tensorflow as tf

import ringtrain.keras as hvd
from data import load_digits_split


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=50, help="rows per rank per step")
    parser.add_argument("--lr", type=float, default=0.5, help="learning rate on one rank (times the world's size)")
    parser.add_argument("--commit-every", type=int, default=4, help="batches between checks for workers that joined")
    parser.add_argument("--demo-kill", type=int, metavar="RANK",
                        help="this rank SIGKILLs itself in the middle of epoch 2 (to watch a recovery)")
    parser.add_argument("--demo-pace", type=float, default=0.0, metavar="SECONDS",
                        help="sleep this long after each batch while the world has fewer workers than it started "
                             "with (to watch a new worker come in)")
    return parser.parse_args()


def main():
    args = parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    hvd.init()
    started_with = hvd.size()
    keras.utils.set_random_seed(0)
    (x_train, y_train), (x_test, y_test) = load_digits_split(0.2, seed=0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(100, activation="sigmoid"),
                              keras.layers.Dense(10)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(args.lr * hvd.size())),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    sampler = hvd.elastic.ElasticSampler(range(len(y_train)), shuffle=True, seed=0)
    state = hvd.elastic.KerasState(model, epoch=0, sampler_state=sampler.state_dict())

    def scale_lr():                     # after every change of the world
        model.optimizer.learning_rate.assign(args.lr * hvd.size())

    state.register_reset_callbacks([scale_lr])

    def batches():
        """This rank's batches; a rank whose share ran out trains on one row of weight 0 (every rank steps)."""
        for batch in range(sampler.steps(args.batch_size)):
            rows = sampler.get_indices(batch, args.batch_size)
            if rows:
                yield x_train[rows], y_train[rows], np.ones(len(rows), np.float32)
            else:
                yield x_train[:1], y_train[:1], np.zeros(1, np.float32)

    def next_epoch(epoch):
        sampler.set_epoch(epoch + 1)
        state.sampler_state = sampler.state_dict()

    class RecordBatches(keras.callbacks.Callback):
        def on_batch_begin(self, batch, logs=None):
            if (args.demo_kill == hvd.rank() and state.epoch == 2 and batch == 2 and hvd.size() > 1
                    and first_epoch == [0]):       # (a worker that joins in epoch 2 takes the slot, not the kill)
                os.kill(os.getpid(), signal.SIGKILL)

        def on_batch_end(self, batch, logs=None):
            sampler.record_batch(batch, args.batch_size)
            state.sampler_state = sampler.state_dict()
            if hvd.size() < started_with:
                time.sleep(args.demo_pace)

        def on_epoch_end(self, epoch, logs=None):
            next_epoch(epoch)

    callbacks = [RecordBatches(), hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=args.commit_every)]

    first_epoch = []                    # the epoch this worker first trains in: > 0 when it joined later

    @hvd.elastic.run
    def train(state):
        first_epoch[:] = first_epoch or [state.epoch]
        sampler.load_state_dict(state.sampler_state)        # the record handed over, dealt over this world
        while state.epoch < args.epochs:
            if sampler.steps(args.batch_size):
                model.fit(batches(), steps_per_epoch=sampler.steps(args.batch_size), initial_epoch=state.epoch,
                          epochs=state.epoch + 1, callbacks=callbacks, verbose=0)
            else:       # the world changed after the epoch's last batch, before fit could end the epoch
                next_epoch(state.epoch)
                state.epoch += 1
            state.commit()
            _, accuracy = model.evaluate(x_test, y_test, verbose=0)
            if hvd.rank() == 0:
                print(f"epoch {state.epoch:3d}/{args.epochs}  workers {hvd.size()}  test accuracy {accuracy:.4f}",
                      flush=True)

    train(state)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    if hvd.rank() == 0:
        print(f"final: workers {hvd.size()}  epochs {state.epoch}  test accuracy {accuracy:.4f}", flush=True)


if __name__ == "__main__":
    main()
