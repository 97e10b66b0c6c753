"""The elastic Keras job of tests/test_elastic.py: model.fit with KerasState and the elastic callbacks. As in
train_counts.py, weight `counts[i]` (a bias-free Dense kernel) gains exactly 1 each time sample i is trained in the
committed trajectory (loss -sum(counts . onehot), summed; SGD lr 1; op Sum), so counts == 1 after the epoch iff
every sample was trained once. Same environment switches and output lines as train_counts.py, except: LATE_RANK
fails before the end callbacks of batch KILL_STEP-1 (so before that batch is counted towards the next commit), and
with GROW_HOSTS_FILE every rank waits at batch GROW_STEP until it has heard of the new worker, so that
CommitStateCallback's next commit raises HostsUpdatedInterrupt (on every rank at the same batch)."""
import hashlib
import os
import time

import keras
import numpy as np
import tensorflow as tf

import ringtrain.keras as hvd
from ringtrain.world import elastic_worker as elastic_worker
from late_failure import fail_with_the_world

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
N, BATCH = 48, 4

hvd.init()
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((N,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])


class NegativeSum(keras.losses.Loss):
    def __init__(self):
        super().__init__(reduction="sum")

    def call(self, y_true, y_pred):
        return -y_pred[:, 0]


model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), op=hvd.Sum), loss=NegativeSum())
sampler = hvd.elastic.ElasticSampler(list(range(N)), shuffle=True, seed=7)
state = hvd.elastic.KerasState(model, sampler_state=sampler.state_dict(), epoch=0, batch=0, step=0,
                               first_size=hvd.size())
last_commit = {"digest": None}


def say(text):
    os.write(1, f"rank {hvd.rank()}: {text}\n".encode())


def digest():
    h = hashlib.sha256()
    for value in model.get_weights() + [v.numpy() for v in model.optimizer.variables]:
        h.update(np.ascontiguousarray(value).tobytes())
    h.update(repr((sorted(state.sampler_state["processed_indices"]), state.epoch, state.step)).encode())
    return h.hexdigest()[:16]


class SamplerState(keras.callbacks.Callback):
    """Keeps the sampler's record in the state (an ObjectState attribute) and digests each commit."""

    def on_batch_end(self, batch, logs=None):
        sampler.record_batch(batch, BATCH)
        state.sampler_state = sampler.state_dict()
        state.step += 1
        if batch % 2 == 1:
            last_commit["digest"] = digest()     # CommitStateCallback(batches_per_commit=2) commits next


class Faults(keras.callbacks.Callback):
    def on_batch_begin(self, batch, logs=None):
        if hvd.size() != state.first_size or state.step >= 1000:
            return
        if str(hvd.rank()) == os.environ.get("KILL_RANK") and batch == int(os.environ["KILL_STEP"]):
            say(f"KILLED at {time.time():.3f}")
            os.kill(os.getpid(), 9)
        if os.environ.get("GROW_HOSTS_FILE") and batch == int(os.environ["GROW_STEP"]):
            if hvd.rank() == 0:
                with open(os.environ["GROW_HOSTS_FILE"], "a") as f:
                    f.write("localhost:1\n")
            wait_for_news_of_the_new_worker()   # then CommitStateCallback's next commit raises HostsUpdatedInterrupt

    def on_batch_end(self, batch, logs=None):          # first in the list: before the batch's other callbacks
        if (hvd.size() == state.first_size and state.step < 1000 and str(hvd.rank()) == os.environ.get("LATE_RANK")
                and batch == int(os.environ["KILL_STEP"]) - 1):
            fail_with_the_world()


def wait_for_news_of_the_new_worker():
    """Until the driver has told this rank that a worker is ready to join (what the next commit's check acts on)."""
    for _ in range(600):
        if not elastic_worker.client().host_updates.empty():
            return
        time.sleep(0.1)
    raise RuntimeError("the new worker was never announced")


def batches():
    """This rank's batches; a rank whose shard ran out sends one sample of weight 0 (every rank steps alike)."""
    for b in range(sampler.steps(BATCH)):
        x = np.zeros((BATCH, N), np.float32)
        weights = np.zeros(BATCH, np.float32)
        for row, i in enumerate(sampler.get_indices(b, BATCH)):
            x[row, i], weights[row] = 1.0, 1.0
        yield x, np.zeros(BATCH, np.float32), weights


def on_reset():
    say(f"RESET live={digest()} committed={last_commit['digest']}")


state.register_reset_callbacks([on_reset])
callbacks = [Faults(), SamplerState(), hvd.elastic.CommitStateCallback(state, batches_per_commit=2),
             hvd.elastic.UpdateBatchStateCallback(state), hvd.elastic.UpdateEpochStateCallback(state)]


@hvd.elastic.run(rollback=True)     # Horovod's mode: these cases check the roll-back to the last commit
def train(state):
    sampler.load_state_dict(state.sampler_state)       # after a roll-back or sync: the committed record
    say(f"START size={hvd.size()} digest={digest()}")
    while state.epoch < 1:
        model.fit(batches(), steps_per_epoch=sampler.steps(BATCH), initial_epoch=state.epoch,
                  epochs=state.epoch + 1, callbacks=callbacks, verbose=0)
        state.step = 1000
        sampler.set_epoch(state.epoch)
        state.sampler_state = sampler.state_dict()
        last_commit["digest"] = digest()
        state.commit()


train(state)
counts = model.get_weights()[0][:, 0]
ok = bool(np.array_equal(counts, np.ones(N, np.float32)))
say(f"FINAL size={hvd.size()} digest={digest()} counts={'ok' if ok else counts.astype(int).tolist()}")
