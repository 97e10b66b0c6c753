"""ringtrain.keras.load_model and callbacks.BestModelCheckpoint (Horovod's names) on N ranks, against the model that
never left memory: a loaded model trains on exactly as the original does (its optimizer state kept, its gradients
averaged), and the best-model checkpoint holds the weights of the best epoch, written by rank 0 only."""
import os
import tempfile

import keras
import numpy as np
import pytest

import ringtrain.keras as hvd

pytestmark = pytest.mark.mpi(min_size=2)


def _model():
    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(2)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)), loss="mse")
    return model


def _data(rank, seed):
    rng = np.random.default_rng([seed, rank])
    return rng.standard_normal((8, 3)).astype(np.float32), rng.standard_normal((8, 2)).astype(np.float32)


def _shared_dir():
    return hvd.broadcast_object(tempfile.mkdtemp(prefix="ringtrain-keras-") if hvd.rank() == 0 else None, 0)


def test_load_model_goes_on_training_as_the_original():
    original = _model()
    original.fit(*_data(hvd.rank(), 0), batch_size=4, epochs=2, verbose=0)
    path = os.path.join(_shared_dir(), "model.keras")
    if hvd.rank() == 0:
        original.save(path)
    hvd.barrier()
    loaded = hvd.load_model(path)
    assert isinstance(loaded.optimizer, keras.optimizers.SGD) and hasattr(loaded.optimizer, "_ringtrain")
    assert int(loaded.optimizer.iterations.numpy()) == 4
    for a, b in zip(original.optimizer.variables, loaded.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())          # momentum kept, not rebuilt from config
    for model in (original, loaded):
        model.fit(*_data(hvd.rank(), 1), batch_size=4, epochs=1, verbose=0)   # different data on each rank
    for a, b in zip(original.weights, loaded.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)
    weights = [w.numpy() for w in loaded.weights]
    for other in hvd.allgather_object(weights):                        # averaged: every rank the same
        for a, b in zip(weights, other):
            np.testing.assert_array_equal(a, b)


class _Score(keras.callbacks.Callback):
    """Puts a made-up 'score' in the epoch logs (best at epoch 1) and keeps the weights of every epoch."""

    def __init__(self):
        super().__init__()
        self.weights = []

    def on_epoch_end(self, epoch, logs=None):
        logs["score"] = [3.0, 1.0, 2.0][epoch]
        self.weights.append([w.numpy().copy() for w in self.model.weights])


def test_best_model_checkpoint_keeps_the_best_epoch_written_by_rank_0():
    folder = _shared_dir()
    model = _model()
    score = _Score()
    best = hvd.callbacks.BestModelCheckpoint(monitor="score", mode="min", save_weights_only=True)
    with pytest.raises(ValueError, match="no filepath"):
        model.fit(*_data(hvd.rank(), 2), epochs=1, verbose=0, callbacks=[best])
    best.filepath = os.path.join(folder, f"best_{hvd.rank()}.weights.h5")
    model.fit(*_data(hvd.rank(), 2), batch_size=4, epochs=3, verbose=0, callbacks=[score, best])
    hvd.barrier()
    assert sorted(os.listdir(folder)) == ["best_0.weights.h5"]          # rank 0 only
    restored = _model()
    restored.load_weights(os.path.join(folder, "best_0.weights.h5"))
    for a, b in zip(restored.weights, score.weights[1]):
        np.testing.assert_array_equal(a.numpy(), b)
