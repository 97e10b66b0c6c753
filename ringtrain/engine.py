"""The background engine: one thread per process that negotiates, fuses and runs every collective.

caller thread                      engine thread (this module)
  collectives.* ──submit()──► queue ──► tell rank 0 (names or cache ids) ──► rank 0 plans the order
                                      ◄── actions (same list on every rank) ◄──┘
  handle.wait() ◄── results ◄── pack into staging ─► transport (ring) ─► unpack (1/N fused) ◄┘
All MPI traffic of ringtrain happens on this thread (the caller thread only queues), so MPI_THREAD_SERIALIZED is
enough, and every wait is a polled wait that notices dead peers (watchdog) and never sleeps inside MPI.
"""
import atexit
import logging
import os
import queue
import sys
import threading
import time

from mpi4py import MPI

from . import errors
from .errors import RankFailureError, RingtrainError, ShutdownError, StallError
from .fusion import HostOps
from .negotiation import Coordinator
from .ops import DTYPES, ReduceOp
from .transports import choice
from .transports.base import even_counts
from .watchdog import Watchdog

log = logging.getLogger("ringtrain")

TAG_TO_COORDINATOR = 11
TAG_FROM_COORDINATOR = 12
STALL_CHECK_PERIOD_S = 0.5
DEAD_PEER_EXIT_GRACE_S = 5.0
SPIN_POLLS = 50                # passes (~5 us each) spent spinning right after activity, before sleeping
FAST_POLL_S = 2e-5             # poll period while an answer is owed (the OS rounds it up to ~60 us)
FAST_POLLS = 200               # ... for about the first 10 ms, then back off to cycle_time
IDLE_SLEEP_S = 0.02           # engine sleep with nothing in flight (still wakes at once on submit)


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


class Engine:
    def __init__(self, topology, config):
        self.topo = topology
        self.config = config
        self.rank, self.size = topology.rank, topology.size
        self.ctrl = topology.world.Dup()
        self.watchdog = Watchdog(topology.local_peers, config.peer_check_s)
        self._sends = []                # outstanding isend requests on ctrl
        self.watchdog.progress = self._reap_sends
        self.host_ops = HostOps()
        self.transports = {"cpu": choice.host_transport(topology, config, self.watchdog)}
        self.coordinator = (Coordinator(self.size, config.fusion_threshold, config.stall_warning_s,
                                        config.stall_timeout_s) if self.rank == 0 else None)
        self.cache = {}                 # (name, Meta) -> id assigned by rank 0
        self.inflight = {}              # name -> Request, owned by the engine thread
        self.submitted_names = set()    # names queued or in flight, guarded by _lock (duplicate detection)
        self.queue = queue.SimpleQueue()
        self.wake = threading.Event()
        self._lock = threading.Lock()
        self.failed = None              # a fatal RingtrainError: every later call raises it
        self.join_handle = None
        self.shutdown_requested = False
        self.finished = threading.Event()
        self.timeline, self.stats = _optional_observers(config, self.rank)
        self._bucket_count = 0
        self.thread = threading.Thread(target=self._main, name="ringtrain-engine", daemon=True)
        self.thread.start()

    # ---------------------------------------------------------------- caller side
    def submit(self, request):
        with self._lock:
            if self.failed is not None:
                raise self.failed
            if self.shutdown_requested:
                raise ShutdownError("ringtrain is shutting down; no new collectives")
            if request.name in self.submitted_names:
                raise ValueError(f"tensor name {request.name!r} is already in flight on rank {self.rank}; "
                                 "wait for it before reusing the name")
            self.submitted_names.add(request.name)
        self.queue.put(request)
        self.wake.set()

    def join(self, handle):
        with self._lock:
            if self.failed is not None:
                raise self.failed
        self.queue.put(("join", handle))
        self.wake.set()

    def shutdown(self, timeout):
        with self._lock:
            self.shutdown_requested = True
        self.queue.put(("shutdown", None))
        self.wake.set()
        if not self.finished.wait(timeout):
            log.warning("rank %d: shutdown() waited %.0fs for the other ranks to shut down; leaving anyway",
                        self.rank, timeout)
            return False
        self.thread.join(1.0)
        return True

    def transport_name(self, device="cpu"):
        t = self.transports.get(device)
        return t.name if t is not None else None

    # ---------------------------------------------------------------- engine thread
    def _main(self):
        try:
            self._loop()
        except RankFailureError as e:
            self._fail(e, fatal_peer=True)
        except BaseException as e:  # a bug in ringtrain itself: never leave callers waiting forever
            log.exception("rank %d: ringtrain engine crashed", self.rank)
            self._fail(RingtrainError(f"ringtrain engine on rank {self.rank} crashed: {e!r}"))
        finally:
            self.finished.set()

    def _loop(self):
        idle = 0
        next_stall_check = time.monotonic() + STALL_CHECK_PERIOD_S
        while True:
            busy = self._drain_local_queue()
            if self.rank == 0:
                busy |= self._receive_submissions()
                actions = self.coordinator.plan()
                if time.monotonic() > next_stall_check:
                    next_stall_check = time.monotonic() + STALL_CHECK_PERIOD_S
                    warnings, fatal = self.coordinator.check_stalls()
                    if warnings:
                        actions = [("warn", w) for w in warnings] + actions
                    if fatal:
                        actions = [("abort", fatal)]
                if actions:
                    new_cache = self.coordinator.take_new_cache_entries()
                    for r in range(1, self.size):
                        self._isend(("actions", actions, new_cache), r, TAG_FROM_COORDINATOR)
                    self.cache.update(new_cache)
            else:
                actions = self._receive_actions()
            if actions:
                busy = True
                if self._execute(actions):
                    return
            self._reap_sends()
            self.watchdog.check("the next collective")
            if busy:
                idle = 0
                continue
            # Nothing to do this pass. With collectives in flight an answer (or a peer's submission) can arrive any
            # moment, so poll every few tens of microseconds, backing off to cycle_time. With nothing in flight no
            # answer can be owed to us: sleep long, waking at once for a local submission.
            idle += 1
            if self.inflight or self.join_handle is not None or (self.coordinator and self.coordinator.pending):
                if idle < SPIN_POLLS:
                    time.sleep(0)   # only yield the GIL: an OS sleep costs ~60 us, a negotiation round trip two
                    continue
                delay = FAST_POLL_S if idle < FAST_POLLS else min(self.config.cycle_time_ms * 1e-3,
                                                                   FAST_POLL_S * (idle - FAST_POLLS + 1))
            else:
                delay = IDLE_SLEEP_S
            if self.wake.wait(delay):
                self.wake.clear()

    def _drain_local_queue(self):
        items = []
        control = []
        while True:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, tuple):
                control.append(item)
                continue
            item.handle.times["queued"] = time.perf_counter()
            self.inflight[item.name] = item
            key = (item.name, item.meta)
            items.append(self.cache.get(key, key))
        if items:
            self._to_coordinator(("submit", items))
        for kind, handle in control:
            if kind == "join":
                self.join_handle = handle
            self._to_coordinator((kind,))
        return bool(items or control)

    def _to_coordinator(self, message):
        if self.rank == 0:
            self._coordinate(0, message)
        else:
            self._isend(message, 0, TAG_TO_COORDINATOR)

    def _coordinate(self, rank, message):
        kind = message[0]
        if kind == "submit":
            self.coordinator.submit(rank, message[1])
        elif kind == "join":
            self.coordinator.join(rank)
        elif kind == "shutdown":
            self.coordinator.shutdown(rank)

    def _receive_submissions(self):
        got = False
        status = MPI.Status()
        while self.ctrl.iprobe(source=MPI.ANY_SOURCE, tag=TAG_TO_COORDINATOR, status=status):
            message = self.ctrl.recv(source=status.Get_source(), tag=TAG_TO_COORDINATOR)
            self._coordinate(status.Get_source(), message)
            got = True
        return got

    def _receive_actions(self):
        actions = []
        while self.ctrl.iprobe(source=0, tag=TAG_FROM_COORDINATOR):
            _, more, new_cache = self.ctrl.recv(source=0, tag=TAG_FROM_COORDINATOR)
            self.cache.update(new_cache)
            actions.extend(more)
        return actions

    def _isend(self, message, dest, tag):
        # never a blocking send: the destination may be busy in a ring step that needs us
        self._sends.append(self.ctrl.isend(message, dest=dest, tag=tag))

    def _reap_sends(self):
        if self._sends:
            self._sends = [r for r in self._sends if not r.Test()]

    # ---------------------------------------------------------------- executing actions
    def _execute(self, actions):
        """Run the actions in order; True when the engine should stop."""
        for action in actions:
            kind = action[0]
            if kind == "shutdown":
                self._finish_shutdown()
                return True
            if kind == "abort":
                self._fail(StallError(action[1]))
                continue
            if kind == "warn":
                log.warning("rank %d: %s", self.rank, action[1])
                continue
            if kind == "error":
                _, names, message, cls_name = action
                for name in names:
                    self._complete_error(name, getattr(errors, cls_name)(message))
                continue
            if kind == "join_done":
                if self.join_handle is not None:
                    self.join_handle._set_result(action[1])
                    self.join_handle = None
                continue
            try:
                self._run_collective(action)
            except RankFailureError:
                raise
            except Exception as e:  # a local failure on one tensor must not take the engine down
                names = action[1] if kind == "allreduce" else [action[1]]
                wrapped = e if isinstance(e, RingtrainError) else RingtrainError(
                    f"rank {self.rank}: {kind} of {', '.join(map(repr, names[:4]))} failed: {e!r}")
                for name in names:
                    self._complete_error(name, wrapped)
        return False

    def _take(self, name):
        req = self.inflight.pop(name, None)
        if req is not None:
            with self._lock:
                self.submitted_names.discard(name)
            req.handle.times["started"] = time.perf_counter()
            if self.timeline is not None:
                t = req.handle.times
                self.timeline.span(name, "queued", t["submitted"], t["queued"])
                self.timeline.span(name, "negotiated", t["queued"], t["started"])
        return req

    def _complete(self, req, result, ops):
        req.handle._set_result(result, ops.done_event())

    def _complete_error(self, name, error):
        req = self._take(name)
        if req is not None:
            req.handle._set_error(error)

    def _ops(self, device):
        if device == "cpu":
            return self.host_ops
        from . import gpu
        return gpu.device_ops()

    def _transport(self, device):
        t = self.transports.get(device)
        if t is None:   # first device collective: every rank reaches this action at the same point, so creation is collective
            t = self.transports[device] = choice.device_transport(self.topo, self.config, self.watchdog)
        return t

    def _run_collective(self, action):
        kind = action[0]
        start = time.perf_counter()
        if kind == "allreduce":
            _, names, metas = action
            nbytes = self._allreduce(names, metas)
            label = names
        else:
            name, meta = action[1], action[2]
            label = [name]
            req = self._take(name)
            ops = req.ops if req is not None else self._ops(meta.device)
            if req is not None and req.ready_event is not None:
                ops.wait_event(req.ready_event)
            transport = self._transport(meta.device) if kind != "barrier" else None
            nbytes = meta.nbytes
            if kind == "allgather":
                result = self._allgather(req, meta, action[3], transport, ops)
            elif kind == "alltoall":
                result = self._alltoall(req, meta, action[3], transport, ops)
            elif kind == "broadcast":
                transport.broadcast(req.out.reshape(-1), meta.root)
                result = req.out
            elif kind == "reducescatter":
                result = self._reducescatter(req, meta, transport, ops)
            elif kind == "barrier":
                result = None
            else:
                raise RingtrainError(f"unknown collective kind {kind!r}")
            self._complete(req, result, ops)
        elapsed = time.perf_counter() - start
        if self.stats is not None:
            self.stats.record(kind, nbytes, elapsed)
        if self.timeline is not None:
            self._bucket_count += 1
            self.timeline.bucket(self._bucket_count, start, start + elapsed, nbytes, label,
                                 self.transport_name(action[2][0].device if kind == "allreduce" else action[2].device))

    def _allreduce(self, names, metas):
        reqs = [self._take(n) for n in names]
        meta = metas[0]
        dtype = DTYPES[meta.dtype]
        ops = self._ops(meta.device)
        transport = self._transport(meta.device)
        sizes = [_numel(m.shape) for m in metas]
        total = sum(sizes)
        for r in reqs:
            if r is not None and r.ready_event is not None:
                ops.wait_event(r.ready_event)
        prescale, postscale = meta.scales
        if self.size == 1:
            # nothing to exchange: skip the copies through the staging buffer (a 25 MB bucket costs ms each way)
            for r in reqs:
                if r.out is not r.array or prescale * postscale != 1.0:
                    ops.unpack(r.array.reshape(-1), [r.out.reshape(-1)], prescale * postscale)
                self._complete(r, r.out, ops)
            return total * dtype.itemsize
        staging = transport.staging_buffer(total * dtype.itemsize).view(dtype)
        t0 = time.perf_counter()
        ops.pack([r.array.reshape(-1) if r is not None else n for r, n in zip(reqs, sizes)], staging)
        if prescale != 1.0:
            ops.scale(staging, prescale)
        t1 = time.perf_counter()
        transport.allreduce(staging, ReduceOp(meta.op))
        t2 = time.perf_counter()
        scale = postscale / self.size if meta.op == ReduceOp.AVERAGE else postscale
        ops.unpack(staging, [r.out.reshape(-1) if r is not None else n for r, n in zip(reqs, sizes)], scale)
        if self.timeline is not None:
            t3 = time.perf_counter()
            for r in reqs:
                if r is not None:
                    for phase, a, b in (("packed", t0, t1), ("ring", t1, t2), ("unpacked", t2, t3)):
                        self.timeline.span(r.name, phase, a, b)
        for r in reqs:
            if r is not None:
                self._complete(r, r.out, ops)
        return total * dtype.itemsize

    def _allgather(self, req, meta, first_dims, transport, ops):
        row = _numel(meta.shape[1:])
        counts = [d * row for d in first_dims]
        out = ops.empty((sum(first_dims),) + tuple(meta.shape[1:]), DTYPES[meta.dtype])
        flat = out.reshape(-1)
        start = sum(counts[:self.rank])
        flat[start:start + counts[self.rank]] = req.array.reshape(-1)
        transport.allgather(flat, counts)
        return out

    def _alltoall(self, req, meta, splits, transport, ops):
        row = _numel(meta.shape[1:])
        send_counts = [s * row for s in splits[self.rank]]
        recv_rows = [splits[src][self.rank] for src in range(self.size)]
        out = ops.empty((sum(recv_rows),) + tuple(meta.shape[1:]), DTYPES[meta.dtype])
        transport.alltoall(req.array.reshape(-1), send_counts, out.reshape(-1), [r * row for r in recv_rows])
        return out, recv_rows

    def _reducescatter(self, req, meta, transport, ops):
        rows = even_counts(meta.shape[0], self.size)
        row = _numel(meta.shape[1:])
        buf = ops.copy(req.array.reshape(-1))
        counts = [r * row for r in rows]
        transport.reducescatter(buf, counts, ReduceOp(meta.op))
        start = sum(counts[:self.rank])
        out = ops.empty((rows[self.rank],) + tuple(meta.shape[1:]), DTYPES[meta.dtype])
        prescale, postscale = meta.scales
        scale = prescale * postscale / (self.size if meta.op == ReduceOp.AVERAGE else 1)
        ops.unpack(buf[start:start + counts[self.rank]], [out.reshape(-1)], scale)
        return out

    # ---------------------------------------------------------------- failure and shutdown
    def _fail(self, error, fatal_peer=False):
        with self._lock:
            if self.failed is None:
                self.failed = error
        for name in list(self.inflight):
            self._complete_error(name, error)
        if self.join_handle is not None:
            self.join_handle._set_error(error)
        while True:   # requests still in the local queue
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                break
            handle = item[1] if isinstance(item, tuple) else item.handle
            if handle is not None:
                handle._set_error(error)
        if fatal_peer:
            # a peer is gone: MPI can no longer finish collectives (MPI_Finalize included), so make sure this
            # process ends non-zero soon even if the caller ignores the error
            print(f"ringtrain rank {self.rank}: {error}; exiting", file=sys.stderr, flush=True)
            _arm_hard_exit(DEAD_PEER_EXIT_GRACE_S)

    def _finish_shutdown(self):
        error = ShutdownError(f"rank {self.rank}: ringtrain was shut down before this collective completed")
        for name in list(self.inflight):
            self._complete_error(name, error)
        if self.stats is not None:
            try:
                table = self.stats.summary(self.ctrl)
                if table:
                    log.info("communication summary:\n%s", table)
            except Exception:
                log.debug("communication summary failed", exc_info=True)
        if self.timeline is not None:
            self.timeline.close()

    def close(self):
        """Free MPI resources; only after the engine thread stopped cleanly."""
        for t in self.transports.values():
            try:
                t.close()
            except Exception:
                log.debug("closing transport failed", exc_info=True)
        try:
            self.ctrl.Free()
        except Exception:
            pass


def _optional_observers(config, rank):
    """Timeline and communication statistics, when those modules exist and are asked for."""
    timeline = stats = None
    try:
        from .timeline import open_timeline
        timeline = open_timeline(config, rank)
    except ImportError:
        pass
    try:
        from .stats import CommStats
        stats = CommStats()
    except ImportError:
        pass
    return timeline, stats


_hard_exit_armed = False


def _arm_hard_exit(grace):
    global _hard_exit_armed
    if _hard_exit_armed:
        return
    _hard_exit_armed = True

    def _exit():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    timer = threading.Timer(grace, _exit)
    timer.daemon = True
    timer.start()
    # interpreter exit before the timer fires must not run MPI_Finalize against a dead peer either
    atexit.register(_exit)
