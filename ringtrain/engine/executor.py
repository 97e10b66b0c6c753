"""Runs one agreed collective on this rank: picks the transport and buffer ops, packs, runs the ring, unpacks, and
completes the requests' handles. The only code that reads or writes tensor or slot data. Knows nothing of
agreement; the engine hands it a Collective (model.py: which tensors, where their data is, what scales apply)
and this rank's requests for its names (None where this rank has no request: it joined and contributes zeros), or,
for the express path, the Collective and one bare array.

Copies: an allreduce packs its tensors into the transport's staging buffer -- for shm that is this rank's region
of the shared window, so the pack IS the copy-in -- and unpacks with Average's 1/N (and any postscale) fused into
the copy-out. Staging buffers persist across calls; the only per-call allocations are results the API returns.
"""
import logging
import time

from .model import Source, express_eligible
from .fusion import ops_for
from ..ops import DTYPES, ReduceOp, reduce_in_rank_order
from ..timeline import open_timeline
from ..stats import CommStats
from ..transports import choice
from ..transports.base import even_counts
from ..transports.segments import Segments

log = logging.getLogger("ringtrain")


def _address(array):
    """Where a numpy or cupy array's data starts."""
    interface = getattr(array, "__array_interface__", None) or array.__cuda_array_interface__
    return interface["data"][0]


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def _flat(array):
    """The array as 1-D: itself when it is already (Segments always are). The transport knows an array it reduces
    every step (a gradient bucket) by identity, and a reshape would make a new array object each time."""
    return array if isinstance(array, Segments) or array.ndim == 1 else array.reshape(-1)


def _solo(sources, targets, factor, ops):
    """An allreduce at one rank: each target <- its source times factor (the op's scales); a target that is its
    source with factor 1 is left alone."""
    for src, dst in zip(sources, targets):
        if dst is not src or factor != 1.0:
            ops.unpack(src.reshape(-1), [dst.reshape(-1)], factor)


class Executor:
    def __init__(self, topology, config, watchdog):
        self.topo, self.config, self.watchdog = topology, config, watchdog
        self.rank, self.size = topology.rank, topology.size
        self.transports = {"cpu": choice.host_transport(topology, config, watchdog)}
        self.timeline = open_timeline(config, self.rank)
        self.stats = CommStats()
        self._bucket_count = 0

    @staticmethod
    def copy_into_slot(slot, array):
        """An eager allreduce's data into this rank's slot of the agreement cycle (the exchange publishes the slot
        right after: cycle_exchange.py moves slots, this writes what is in them)."""
        slot[:] = array.reshape(-1)

    def transport(self, device):
        t = self.transports.get(device)
        if t is None:   # first device collective: every rank reaches this action at the same point, so creation is collective
            t = self.transports[device] = choice.device_transport(self.topo, self.config, self.watchdog)
        return t

    def transport_name(self, device="cpu"):
        t = self.transports.get(device)
        return t.name if t is not None else None

    # ------------------------------------------------------------------------------------------------ dispatch
    def run(self, action, reqs):
        """Execute the Collective `action`; complete every non-None request in reqs (aligned with action.names)."""
        kind, meta = action.kind, action.metas[0]
        if action.source is Source.SLOTS:     # one small host allreduce, every rank's copy in the cycle's slots
            req = reqs[0]
            self.reduce_slots(action, req.outs[0])
            handle = req.handle
            handle._set_result(req.result())
            # no transport time to measure: the collective's time is from its submission to the cycle that did it
            self.stats.record(kind, meta.nbytes, handle.times["finished"] - handle.times["submitted"])
            return
        ops = ops_for(meta.device)
        for r in reqs:
            if r is not None and r.ready_event is not None:
                ops.wait_event(r.ready_event)
        start = time.perf_counter()
        if kind == "allreduce":
            nbytes = self._allreduce(action, reqs, ops)
        else:
            req = reqs[0]
            nbytes = meta.nbytes
            if kind == "barrier":
                result = None
            elif kind == "broadcast":
                self.transport(meta.device).broadcast(req.out.reshape(-1), meta.root)
                result = req.out
            elif kind == "allgather":
                result = self._allgather(req, meta, action.first_dims, ops)
            elif kind == "alltoall":
                result = self._alltoall(req, meta, action.splits, ops)
            elif kind == "reducescatter":
                result = self._reducescatter(req, action, ops)
            else:
                raise ValueError(f"unknown collective kind {kind!r}")
            if isinstance(result, ValueError):          # a wrong allgather out: its caller alone learns of it
                req.handle._set_error(result)
            else:
                req.handle._set_result(req.result(result), ops.done_event())
        elapsed = time.perf_counter() - start
        self.stats.record(kind, nbytes, elapsed)
        if self.timeline is not None:
            self._bucket_count += 1
            self.timeline.bucket(self._bucket_count, start, start + elapsed, nbytes, list(action.names),
                                 self.transport_name(meta.device))

    # ------------------------------------------------------------------------------------------------ allreduce
    def _allreduce(self, action, reqs, ops):
        """One bucket: requests (each one or many arrays) packed back to back, one ring allreduce, unpacked."""
        metas = action.metas
        meta = metas[0]
        dtype = DTYPES[meta.dtype]
        prescale, scale = action.prescale, action.scale
        sources, targets = [], []
        for m, r in zip(metas, reqs):
            if r is None:                     # joined: zeros in, nothing out
                n = _numel(m.shape)
                sources.append(n)
                targets.append(n)
            else:
                sources.extend(r.arrays)
                targets.extend(r.outs)
        total = sum(_numel(m.shape) for m in metas)
        if self.size == 1:
            # nothing to exchange: skip the staging copies (a 25 MB bucket costs ms each way)
            _solo(sources, targets, prescale * scale, ops)
        elif len(sources) == 1 and not isinstance(sources[0], int) and express_eligible(meta):
            t0 = time.perf_counter()
            self.allreduce_one(action, sources[0], targets[0])
            if self.timeline is not None:
                self.timeline.span(reqs[0].name, "ring", t0, time.perf_counter())
        else:
            transport = self.transport(meta.device)
            staging = transport.staging_buffer(total * dtype.itemsize).view(dtype)
            t0 = time.perf_counter()
            ops.pack(sources, staging)
            if prescale != 1.0:
                ops.scale(staging, prescale)
            t1 = time.perf_counter()
            if meta.device == "cpu":
                # the same transport call as allreduce_one's: a joined rank packs zeros here while the others take
                # that path, and transports split the scaling between ranks (the owner of a block scales it)
                transport.allreduce_out(staging, staging, ReduceOp(meta.op), scale)
                scale = 1.0
            else:
                transport.allreduce(staging, ReduceOp(meta.op))
            t2 = time.perf_counter()
            ops.unpack(staging, targets, scale)
            if self.timeline is not None:
                t3 = time.perf_counter()
                for r in reqs:
                    if r is not None:
                        for phase, a, b in (("packed", t0, t1), ("ring", t1, t2), ("unpacked", t2, t3)):
                            self.timeline.span(r.name, phase, a, b)
        done = ops.done_event()
        for r in reqs:
            if r is not None:
                r.handle._set_result(r.result(), done)
        return total * dtype.itemsize

    def allreduce_one(self, action, src, dst):
        """One host array, no prescale (a single tensor, or an optimizer's flat bucket): no pack, no unpack -- the
        transport copies in only what peers read and reduces straight into dst. Used for such a bucket and by the
        engine's express path (one agreement cycle, then this), so both run the same transport calls."""
        flat = _flat(src)
        # in place stays in place: two views of one buffer would make the transport copy it onto itself first
        out = flat if dst is src else _flat(dst)
        meta = action.metas[0]
        if isinstance(flat, Segments):       # a grouped express allreduce: its arrays where they lie
            self.transport(meta.device).allreduce_segments(flat, out, ReduceOp(meta.op), action.scale)
        else:
            self.transport(meta.device).allreduce_out(flat, out, ReduceOp(meta.op), action.scale)

    def reduce_slots(self, action, out):
        """An allreduce from the agreement cycle's slots: every rank's copy reduced in rank order straight into
        out, so every rank computes bitwise the same result with no transport call (the cycle was the only
        synchronisation)."""
        reduce_in_rank_order(out.reshape(-1), action.slots, action.metas[0].op, action.scale)

    def express(self, action, array, out):
        """The express path's one array, agreed alone in its own cycle: from the slots or on the transport."""
        if self.size == 1:                   # a communicator of one rank: what _allreduce does at one rank
            if isinstance(array, Segments):
                _solo(array.given, out.given, action.prescale * action.scale, ops_for("cpu"))
            else:
                _solo((array,), (out,), action.prescale * action.scale, ops_for("cpu"))
        elif action.source is Source.SLOTS:
            self.reduce_slots(action, out)
        else:
            self.allreduce_one(action, array, out)

    # ------------------------------------------------------------------------------------------------ the others
    def _allgather(self, req, meta, first_dims, ops):
        """Into req.out when given (in place: a rank whose input already lies at its place in out copies nothing
        in), else a new array. An out of the wrong shape still takes part (peers are in this very collective) and
        comes back as the ValueError its handle raises."""
        row = _numel(meta.shape[1:])
        counts = [d * row for d in first_dims]
        shape = (sum(first_dims),) + tuple(meta.shape[1:])
        out, wrong = req.out, None
        if out is not None and tuple(out.shape) != shape:
            wrong = ValueError(f"allgather {req.name!r}: out has shape {tuple(out.shape)}, the ranks gather "
                               f"{shape}")
        if out is None or wrong is not None:
            out = ops.empty(shape, DTYPES[meta.dtype])
        flat = out.reshape(-1)
        start = sum(counts[:self.rank])
        mine = flat[start:start + counts[self.rank]]
        if mine.size and _address(mine) != _address(req.array):
            mine[...] = req.array.reshape(-1)
        self.transport(meta.device).allgather(flat, counts)
        return out if wrong is None else wrong

    def _alltoall(self, req, meta, splits, ops):
        row = _numel(meta.shape[1:])
        send_counts = [s * row for s in splits[self.rank]]
        recv_rows = [splits[src][self.rank] for src in range(self.size)]
        out = ops.empty((sum(recv_rows),) + tuple(meta.shape[1:]), DTYPES[meta.dtype])
        self.transport(meta.device).alltoall(req.array.reshape(-1), send_counts, out.reshape(-1),
                                             [r * row for r in recv_rows])
        return out, recv_rows

    def _reducescatter(self, req, action, ops):
        meta = action.metas[0]
        dtype = DTYPES[meta.dtype]
        rows = even_counts(meta.shape[0], self.size)
        row = _numel(meta.shape[1:])
        counts = [r * row for r in rows]
        transport = self.transport(meta.device)
        # the input is not ours to overwrite: reduce in the (persistent) staging buffer instead of a fresh copy. On
        # the host the transport reads the input itself (shm: only the blocks peers reduce are copied in, and this
        # rank's block is reduced from the input straight into the staging buffer, a pass less than packing it)
        buf = transport.staging_buffer(meta.nbytes).view(dtype)
        source, prescale = req.array.reshape(-1), action.prescale
        if prescale != 1.0 and (dtype.kind in "iub" or dtype.itemsize == 2):
            # not linear for them: Horovod scales each rank's input and casts it back (integers truncated,
            # 16-bit floats rounded) before the sum
            scaled = ops.empty(source.shape, dtype)
            ops.pack([source], scaled)
            ops.scale(scaled, prescale)
            source, prescale = scaled, 1.0
        if meta.device == "cpu":
            transport.reducescatter_out(source, buf, counts, ReduceOp(meta.op))
        else:
            ops.pack([source], buf)
            transport.reducescatter(buf, counts, ReduceOp(meta.op))
        start = sum(counts[:self.rank])
        out = ops.empty((rows[self.rank],) + tuple(meta.shape[1:]), dtype)
        # a float prescale is applied to the reduced block, not the inputs: the same for a linear reduction
        ops.unpack(buf[start:start + counts[self.rank]], [out.reshape(-1)], prescale * action.scale)
        return out

    # ------------------------------------------------------------------------------------------------ end
    def finish(self, ctrl):
        """At an agreed shutdown: the communication summary (collective over ctrl) and the timeline file."""
        try:
            table = self.stats.summary(ctrl)
            if table:
                log.info("communication summary:\n%s", table)
        except Exception:
            log.debug("communication summary failed", exc_info=True)
        if self.timeline is not None:
            self.timeline.close()

    def close(self):
        for t in self.transports.values():
            try:
                t.close()
            except Exception:
                log.debug("closing transport failed", exc_info=True)
