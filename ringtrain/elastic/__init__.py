"""Elastic training with Horovod's API: jobs that lose and gain workers without stopping.

    import ringtrain.torch as hvd
    hvd.init()
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0)

    @hvd.elastic.run
    def train(state):
        ...                                     # state.commit() every few batches

    train(state)

    ringtrain-run -np 4 --min-np 2 --max-np 6 --host-discovery-script ./discover.sh python train.py

Framework-neutral pieces live here (ObjectState, run, the errors, the worker's side of the driver protocol); the
torch state and sampler in ringtrain.torch.elastic, the Keras state and callbacks in ringtrain.keras.elastic.
"""
from ..errors import ElasticError, HorovodInternalError, HostsUpdatedInterrupt  # noqa: F401
from .runner import run  # noqa: F401
from .state import ObjectState, State  # noqa: F401
