"""Pairwise exchange over a ring transport's point-to-point primitives, for blocks that are not contiguous.

The hierarchy's cross-node step for allgather and reducescatter works on one "column": the blocks of the ranks with
this rank's local rank, one per node, which sit apart in the caller's buffer (node-major order). The ring schedule
(ring.py) wants one buffer with its blocks back to back, so this module runs the other classic schedule on a list of
views instead: step s = 1..n-1, send to rank (me+s) mod n and receive from (me-s) mod n. Every message lands where
it belongs: no packing, no unpacking. Same bytes as a ring; n-1 steps, every peer a direct partner.

    allgather_views(transport, views)          # views[me] is ours; afterwards views[k] holds rank k's
    reducescatter_views(transport, views, op)  # afterwards views[me] holds views[me] reduced over every rank

Each step's block is cut at `config.segment_bytes`; up to `pipeline_depth` (step, segment) tasks are in flight, so
a segment is reduced while the next one travels. No task depends on another (each block is sent as it was before
the call, and received data only ever goes into views[me] or the sender's own view), so any order of completion is
safe; every rank lists its tasks in the same (step, segment) order, and a message's sender and receiver cut the
same block into the same segments, so each rank's oldest task always has its partners posted: no deadlock.
"""
import collections


def allgather_views(transport, views):
    _exchange(transport, views, None, "pairwise allgather")


def reducescatter_views(transport, views, op):
    _exchange(transport, views, op, "pairwise reduce-scatter")


def _segments(view, segment_elements):
    return [view[lo: lo + segment_elements] for lo in range(0, view.size, segment_elements)]


def _exchange(transport, views, op, what):
    n, me = transport.size, transport.rank
    if len(views) != n:
        raise ValueError(f"rank {me}: {what} got {len(views)} views for {n} ranks")
    if n == 1:
        return
    segment = max(1, transport.config.segment_bytes // max(1, views[me].itemsize))
    tasks = []
    for step in range(1, n):
        to, source = (me + step) % n, (me - step) % n
        sends = _segments(views[to] if op is not None else views[me], segment)
        receives = _segments(views[me] if op is not None else views[source], segment)
        for k in range(max(len(sends), len(receives))):
            tasks.append((step, to, sends[k] if k < len(sends) else None,
                          source, receives[k] if k < len(receives) else None))
    in_flight = collections.deque()
    for i, (step, to, send, source, target) in enumerate(tasks):
        if len(in_flight) >= transport.pipeline_depth:
            _finish(transport, in_flight, op, what)
        landing = target
        if target is not None and op is not None:     # a partial sum: lands in scratch, then reduced into ours
            landing = transport.recv_scratch(i % transport.pipeline_depth, target.nbytes).view(target.dtype)
        pending = transport.start_sendrecv(send, to, landing, source)
        in_flight.append((step, to, source, pending, target, landing if landing is not target else None))
    while in_flight:
        _finish(transport, in_flight, op, what)


def _finish(transport, in_flight, op, what):
    step, to, source, pending, target, scratch = in_flight.popleft()
    transport.wait(pending, f"{what} step {step} (rank {transport.rank} <- rank {source}, -> rank {to})")
    if scratch is not None:
        transport.reduce(target, scratch, op)
