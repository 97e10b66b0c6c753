"""The two exceptions hvd.elastic.run acts on, with Horovod's names."""
from ..errors import RingtrainError

# Horovod raises HorovodInternalError when a collective fails (a peer died): roll back to the last commit. Every
# error ringtrain raises on purpose is one, as in ringtrain.torch.
HorovodInternalError = RingtrainError


class HostsUpdatedInterrupt(RuntimeError):
    """Workers were added or removed: re-form the world without rolling back. skip_sync is True when workers were
    only removed (every survivor already holds the same committed state)."""

    def __init__(self, skip_sync=False):
        super().__init__("the set of workers changed: re-forming the world")
        self.skip_sync = skip_sync


class ElasticError(RingtrainError):
    """The elastic job cannot go on (lost its driver, or the driver refused this worker); the message says why."""
