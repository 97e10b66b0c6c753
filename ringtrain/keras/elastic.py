"""hvd.elastic for Keras, with Horovod's names (see ringtrain.elastic and ringtrain.keras.elastic_state)."""
from ringtrain.elastic import (ElasticError, HorovodInternalError, HostsUpdatedInterrupt, ObjectState,  # noqa: F401
                               State)
from ringtrain.keras.elastic_state import (CommitStateCallback, KerasState, TensorFlowKerasState,  # noqa: F401
                                          UpdateBatchStateCallback, UpdateEpochStateCallback, run)
from ringtrain.elastic.sampler import ElasticSampler  # noqa: F401
