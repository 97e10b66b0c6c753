"""hvd.elastic for PyTorch, with Horovod's names (see ringtrain.elastic)."""
from ringtrain.elastic import (ElasticError, HorovodInternalError, HostsUpdatedInterrupt, ObjectState,  # noqa: F401
                               State, run)
from ringtrain.elastic.sampler import ElasticSampler  # noqa: F401
from ringtrain.torch.elastic_state import TorchState  # noqa: F401
