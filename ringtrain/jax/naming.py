"""Collective names for ringtrain.jax, the same on every rank without a message.

A name is given when the collective is traced (or called eagerly): "jax.allreduce.noname.7" is the seventh
allreduce this process traced or called. Every rank runs the same program, so every rank traces the same
collectives in the same order and gives them the same names. A jitted step keeps its names for every call, so in a training loop each
collective is a cached one (the engine's fast path) from the second step on. Shapes are not part of the name: two
ranks passing different shapes to the same collective meet under one name and get the engine's mismatch error
naming both, instead of waiting for each other under two names.
"""
from ringtrain.core.names import auto_name


def collective_name(kind, name, process_set):
    """`name` when given, else "jax.<kind>.noname.<n>" from the core's per-kind counters (reset by init())."""
    set_id = process_set.process_set_id
    return auto_name(f"jax.{kind}" if not set_id else f"jax.{kind}.set{set_id}", name)
