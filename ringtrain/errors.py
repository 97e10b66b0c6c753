"""Every error ringtrain raises on purpose is a RingtrainError subclass, so users can catch them as one family."""


class RingtrainError(RuntimeError):
    """Base class of ringtrain's own errors."""


class NotInitializedError(RingtrainError):
    """A collective was called before ringtrain.init() or after shutdown()."""


class TensorMismatchError(RingtrainError, ValueError):
    """Ranks submitted the same tensor name with different shape, dtype, op or root.
    The message names every rank and what it had."""


class StallError(RingtrainError):
    """A tensor was submitted on some ranks but not on others for longer than RINGTRAIN_STALL_TIMEOUT_S."""


class RankFailureError(RingtrainError):
    """A peer rank died or shut down while a collective still needed it."""


class TransportError(RingtrainError):
    """A transport could not be set up or was asked for something it cannot do."""


class UnsupportedDtypeError(RingtrainError, TypeError):
    """The array's dtype is not one ringtrain reduces or moves."""


class ShutdownError(RingtrainError):
    """The engine was shut down before this request completed."""


class UnsupportedOperationError(RingtrainError, NotImplementedError):
    """A Horovod feature ringtrain does not implement yet (e.g. op=Adasum); the message says what to use instead."""


# The elastic errors: hvd.elastic.run acts on these (Horovod's names).
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
