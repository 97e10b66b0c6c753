"""A one-process float64 reference of Adasum's recursive pairwise rule, written apart from ringtrain.core.adasum.

    pairwise(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b      (a zero side: coefficient 1)
    tree([v0 .. vN-1]) = pairwise(tree(first half), tree(second half))      (Horovod's order of ranks)
"""
import numpy as np


def pairwise(a, b):
    """The rule for two float64 vectors (computed on values divided by the larger magnitude, so squares of values
    near a dtype's tiny or sqrt(max) neither underflow nor overflow)."""
    s = max(np.abs(a).max(initial=0.0), np.abs(b).max(initial=0.0))
    if s == 0:
        return a + b
    x, y = a / s, b / s
    dot, xx, yy = x @ y, x @ x, y @ y
    return (1 - dot / (2 * xx) if xx else 1.0) * a + (1 - dot / (2 * yy) if yy else 1.0) * b


def tree(vectors):
    if len(vectors) == 1:
        return vectors[0]
    half = len(vectors) // 2
    return pairwise(tree(vectors[:half]), tree(vectors[half:]))


def reference(inputs_by_rank):
    """inputs_by_rank[r] = rank r's list of tensors -> the list of results, per tensor, in float64."""
    return [tree([np.asarray(inputs[t], np.float64).reshape(-1) for inputs in inputs_by_rank]).reshape(
        np.shape(inputs_by_rank[0][t])) for t in range(len(inputs_by_rank[0]))]
