"""Horovod's topology-as-tensor calls for TensorFlow (rank_op, size_op, ...): int32 scalar tensors of what the core
knows, usable in graphs (tf.compat.v1 sessions) and eagerly."""
import tensorflow as tf

from ringtrain.core.process_sets import process_sets
from ringtrain.core.state import local_rank, local_size, rank


def _process_set(process_set_id):
    for candidate in process_sets():
        if candidate.process_set_id == process_set_id:
            return candidate
    raise ValueError(f"no process set with id {process_set_id} is registered on this rank")


def size_op(process_set_id: int = 0, name: "str | None" = None) -> tf.Tensor:
    """The number of ranks (of process set `process_set_id`) as an int32 scalar tensor."""
    return tf.constant(_process_set(process_set_id).size(), dtype=tf.int32, name=name)


def rank_op(name: "str | None" = None) -> tf.Tensor:
    """This process's world rank as an int32 scalar tensor."""
    return tf.constant(rank(), dtype=tf.int32, name=name)


def local_size_op(name: "str | None" = None) -> tf.Tensor:
    """The number of ranks on this node as an int32 scalar tensor."""
    return tf.constant(local_size(), dtype=tf.int32, name=name)


def local_rank_op(name: "str | None" = None) -> tf.Tensor:
    """This process's rank on its node as an int32 scalar tensor."""
    return tf.constant(local_rank(), dtype=tf.int32, name=name)


def process_set_included_op(process_set_id: int = 0, name: "str | None" = None) -> tf.Tensor:
    """1 (int32 scalar tensor) when this rank belongs to process set `process_set_id`, else 0."""
    return tf.constant(1 if _process_set(process_set_id).included() else 0, dtype=tf.int32, name=name)
