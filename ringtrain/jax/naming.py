"""Collective names for ringtrain.jax, the same on every rank without a message.

A name is given when the collective is traced (or called eagerly): "jax.allreduce.7" is the seventh allreduce this
process traced or called. Every rank runs the same program, so every rank traces the same collectives in the same
order and gives them the same names. A jitted step keeps its names for every call, so in a training loop each
collective is a cached one (the engine's fast path) from the second step on. Shapes are not part of the name: two
ranks passing different shapes to the same collective meet under one name and get the engine's mismatch error
naming both, instead of waiting for each other under two names.
"""
import collections
import threading

_counts = collections.Counter()
_lock = threading.Lock()


def collective_name(kind, name, process_set):
    if name is not None:
        if not isinstance(name, str) or not name:
            raise TypeError(f"name must be a non-empty str, got {name!r}")
        return name
    set_id = process_set.process_set_id
    kind = kind if not set_id else f"{kind}.set{set_id}"
    with _lock:
        _counts[kind] += 1
        return f"jax.{kind}.{_counts[kind]}"


def reset():
    """At init(): a re-initialised job starts from the same names on every rank."""
    with _lock:
        _counts.clear()
