"""Shared-memory transport for the ranks of ONE node: each rank reduces its block straight from its peers' memory.

    t = SharedMemoryTransport(MPI.COMM_WORLD.Dup(), Config(), Watchdog())
    bucket = t.staging_buffer(nbytes).view(np.float32)   # lives in this rank's region of the shared window
    bucket[:] = gradients                                 # packing IS the copy-in
    t.allreduce(bucket, ReduceOp.SUM)                     # no copy in, no copy out

Layout: an `MPI.Win.Allocate_shared` window on the node communicator; every rank owns a page-aligned header plus
a region: `fusion_threshold` bytes of staging area, then shared_array()'s pool (`shared_pool_bytes`), then the room
for out-of-place results (`result_window_bytes`, result_window()), each page-aligned. Rank 0's header holds one
cache line of flags per rank: [sequence number, byte offset of this collective's data in the owner's region, two
signatures of the collective (one per parity of the sync it is published with)].
A sequence number only grows; every synchronisation point is "bump mine, wait until every rank's is >= mine"
(flag_barrier.FlagBarrier), polled through the Watchdog with its backoff -- no MPI call, no busy spin.

Allreduce of one chunk (blocks laid out the same on every rank; rank p owns block p):
  1. copy-in of the blocks peers will read (skipped when the buffer already lives in our region)  barrier "ready"
  2. rank r reads block r of every peer's region (ring order from r+1, so ranks don't all hit one peer), reduces
     it into its own copy -- one read + one reduce-write per element per peer, no staging copy -- and, piece by
     cache-sized piece, pushes the result into block r of every peer's region ............ barrier "done"
  3. copy-out of the other blocks from our own region (skipped when the buffer lives in our region)
Why this is race-free with two barriers: the positions of block r, in every region, are touched by rank r only
during step 2; "ready" guarantees peers' inputs are in place; "done" guarantees every push has landed and every
read of our region has finished, so the engine may pack the next bucket into it as soon as we return.
Reduce-scatter is steps 1-2 without the push; allgather pulls block p from owner p's region.
Small allreduces (<= SMALL_BYTES) take one barrier, not two: each rank copies its input into one of two small
slots kept outside the region (alternating by call), passes the barrier, and reduces all N slots itself in rank
order (so every rank computes bitwise the same result). A peer can write the same slot again only two small calls
later, past a barrier this rank reaches only after it finished reading -- and no other collective touches the
slots, so nothing else can overwrite them early.
Inputs larger than the region are processed in chunks, each holding 1/K of every block so every rank keeps
working on every chunk.
An out-of-place allreduce whose result lies in our region (result_pool hands out such results) runs the private
chunks, but each chunk's copy-in goes from the input straight to the result's own place, peers reduce and push
there, and there is no copy-out. Every rank publishes, per chunk, where its data lies: its offset (reduced in place
where it lies), _PRIVATE (packed at the region's start) or _direct(offset) (such a result); ranks of the first kind
switch to the chunks at the first barrier when any rank publishes a negative word. Race-free by the same argument:
the result's positions of this chunk are written before "ready" by this rank only (the copy-in, non-temporal
stores fenced before the flag), between "ready" and "done" block p by rank p only, and no rank touches them again
after "done" unless it is handed this offset anew -- which a later collective publishes only for a buffer that
result_pool handed out again, i.e. once nothing refers to the old result.
broadcast and alltoall go through nonblocking MPI on the same communicator.
"""
import logging
import threading
import weakref

import numpy as np
from mpi4py import MPI

from .. import ops, stream_copy
from ..errors import TransportError
from .base import Transport, even_counts, offsets
from .segments import Segments, fill, runs
from . import mpi_util
from .flag_barrier import LINE, LINE_INT64, FlagBarrier

log = logging.getLogger("ringtrain")

_PAGE = 4096
_SEQ, _OFFSET = 0, 1           # int64 slots in a flag line
_PRIVATE = -1                  # the offset a rank publishes when its data is private: packed at its region's start
# What this rank is running -- kind + 256 * itemsize, bytes, checksum of the block counts -- at words 2-4 of its line
# for a collective whose first sync has an even number, 5-7 for an odd one. Two places, because a rank that saw a
# mismatch raises at once and may publish its next collective's signature while a slower peer has not read this one;
# it cannot publish the one after that before that peer reached the next sync, so this one stays readable.
_SIGNATURE_WORDS = 3


def _signature_word(sync):
    return 2 + _SIGNATURE_WORDS * (sync % 2)


def _direct(offset):
    """The word a rank publishes when its result lies at `offset` of its region and it runs chunks (and back)."""
    return -2 - offset


def _NOTHING():
    return None


_KINDS = {1: "allreduce", 2: "reducescatter", 3: "allgather", 4: "allreduce"}   # 4: the one-barrier path
SMALL_BYTES = 64 << 10         # allreduces up to this size use the one-barrier path
_SMALL_SLOT = LINE + SMALL_BYTES   # a line for the call's signature, then the data


class SharedMemoryTransport(mpi_util.NonblockingBroadcastAlltoall, Transport):
    """Reduce-scatter / allgather / allreduce through an MPI shared-memory window; all ranks on one node."""

    name = "shm"
    device = "cpu"
    cache_piece_bytes = 256 << 10   # reduce-then-push granularity: the result is pushed while still in L2
    # Private (not in-window) buffers go through the region in chunks of at most this many bytes even when they
    # would fit whole: what one rank copies in is then still in the shared L3 cache when its peers read it, and
    # the pushed result when the copy-out reads it. 2 ranks, 16 MB, on a 32 MB-L3 EPYC: 3.9-4.4 ms whole,
    # 3.2 ms in 4 MB chunks (2 MB 3.3, 1 MB 3.6: past that the extra barriers cost more); 64 MB 23 -> 13.5 ms;
    # 4 ranks 16 MB 14.6 -> 8.8 ms (benchmarks/results/shm_chunk_sweep.txt).
    private_chunk_bytes = 4 << 20

    def __init__(self, comm, config, watchdog):
        super().__init__(comm, config, watchdog)
        self._closed = True
        self._wire = mpi_util.WireTypes()
        self._limit = config.max_message_elements
        # fresh results of STREAM_BYTES and more are written with non-temporal stores (stream_copy.py)
        self._stream = config.native and stream_copy.available()
        node = mpi_util.one_node_comm(comm, "shm transport", "; use transport 'mpi'")
        self._node = node              # same rank order as comm (key=rank), so node rank == comm rank
        # whole cache lines; at least two int64 per rank so a chunk always has room for a piece of every block
        self.capacity = -(-max(int(config.fusion_threshold), 16 * self.size, LINE) // LINE) * LINE
        header = -(-(self.size * LINE) // _PAGE) * _PAGE
        # after the staging area: a pool for shared_array(), then the room for results (result_window()); whole
        # pages, address space until an array touches them
        pool = -(-max(int(config.shared_pool_bytes), 0) // _PAGE) * _PAGE
        results = -(-max(int(config.result_window_bytes), 0) // _PAGE) * _PAGE
        self._pool_start = self._pool_next = -(-self.capacity // _PAGE) * _PAGE
        self._pool_end = self._pool_start + pool
        self._region_bytes = self._pool_end + results
        self._results_taken = False
        self._pool_lock = threading.Lock()
        self._win = MPI.Win.Allocate_shared(header + self._region_bytes + 2 * _SMALL_SLOT, 1, comm=node)
        # a passive-target epoch for the whole lifetime, so Win.Sync() (a local memory barrier) is legal
        self._win.Lock_all(MPI.MODE_NOCHECK)
        self._closed = False
        segments = []
        for p in range(self.size):
            mem, _ = self._win.Shared_query(p)
            segments.append(np.frombuffer(mem, dtype=np.uint8))
        self._data = [seg[header: header + self._region_bytes] for seg in segments]
        small = header + self._region_bytes
        self._small_slots = [(seg[small: small + _SMALL_SLOT], seg[small + _SMALL_SLOT: small + 2 * _SMALL_SLOT])
                             for seg in segments]
        self._small_calls = 0
        lines = segments[0][: self.size * LINE].view(np.int64).reshape(self.size, LINE_INT64)
        self._flags = FlagBarrier(lines[:, _SEQ], self.rank, self._win, watchdog, config.stall_timeout_s, "shm")
        # the flag lines as Python ints: every collective writes and reads a few words of them, and a numpy call
        # on them costs tens of microseconds right after backward has evicted numpy from the caches
        self._words = memoryview(lines.reshape(-1))
        self._last_in_region = (_NOTHING, None)    # (weakref of an array, its offset): the buffer reduced where it lies
        lines[self.rank, :] = 0                # the window is not zeroed by MPI; each rank clears its own line
        self._win.Sync()
        node.Barrier()
        self._win.Sync()
        self._region_address = self._data[self.rank].__array_interface__["data"][0]

    # ---- buffers ---------------------------------------------------------------------------------------------

    def staging_buffer(self, nbytes):
        """This rank's own region when the bucket fits, so packing into it is the copy-in; else a private buffer
        (and the collectives then copy in chunk by chunk). Valid until close()."""
        if nbytes <= self.capacity:
            return self._data[self.rank][:nbytes]
        return super().staging_buffer(nbytes)

    def shared_array(self, nbytes):
        """Room in this rank's region past the staging area: an allreduce of it (in place) reads peers' copies
        straight from their regions and leaves the result in ours -- no copy-in, no copy-out. None once the pool
        (config.shared_pool_bytes) is used up. Never freed: numpy views of it cannot be tracked (their base is
        the window's buffer), so once one was handed out close() keeps the window mapped until exit."""
        size = -(-max(int(nbytes), 1) // LINE) * LINE
        with self._pool_lock:
            start = self._pool_next
            if self._closed or start + size > self._pool_end:
                return None
            self._pool_next = start + size
        return self._data[self.rank][start: start + int(nbytes)]

    def result_window(self):
        """This rank's room for out-of-place results (config.result_window_bytes, past the shared_array() pool; its
        own part of the region, so what empty_shared() gets never depends on whether results were handed out):
        a uint8 array the caller (result_pool) carves results from, or None when it is empty. The same memory at
        every call. Once handed out, close() keeps the window mapped until exit (as for shared arrays)."""
        with self._pool_lock:
            if self._closed or self._region_bytes == self._pool_end:
                return None
            self._results_taken = True
        return self._data[self.rank][self._pool_end: self._region_bytes]

    def holds(self, buf):
        return self._in_region(self._start(buf), buf.nbytes)

    def _in_region(self, start, nbytes):
        """True when nbytes from byte `start` of our region (see _start) lie wholly inside it."""
        return 0 <= start and start + nbytes <= self._region_bytes

    def _start(self, buf):
        """Where buf's memory starts, in bytes from the start of our region (negative or past it: elsewhere)."""
        return buf.__array_interface__["data"][0] - self._region_address

    def _offset_in_region(self, buf):
        """Byte offset of buf inside our region, or None when buf is ordinary memory (Segments always are)."""
        last, offset = self._last_in_region
        if last() is buf:                 # a bucket reduced in place every step: its array object never moves
            return offset
        if buf.size == 0 or isinstance(buf, Segments):
            return None
        start = self._start(buf)
        if self._in_region(start, buf.nbytes):
            if not buf.flags.c_contiguous:
                raise ValueError(f"rank {self.rank}: shm buffers must be contiguous")
            # weakly: a result in the window (result_pool) is reused only once nothing refers to it
            self._last_in_region = (weakref.ref(buf), start)
            return start
        if -buf.nbytes < start < self._region_bytes:
            raise ValueError(f"rank {self.rank}: buffer of {buf.nbytes} bytes overlaps the end of the shared "
                             f"region ({self._region_bytes} bytes); use staging_buffer(nbytes) with nbytes <= "
                             f"capacity")
        return None

    def _chunks(self, counts, itemsize):
        """Per chunk: [(start in buf, count)] for every block. One chunk when the data fits private_chunk_bytes
        (and the region); else K chunks, each taking 1/K of every block (so every rank reduces in every chunk).
        Depends only on what every rank knows alike -- never on where this rank's buffer lies -- so a rank with
        its data in the region and a rank with private data run the same chunks and barriers."""
        starts = offsets(counts)
        total = sum(counts) * itemsize
        limit = min(self.capacity, max(self.private_chunk_bytes, 16 * self.size * itemsize))
        if total <= limit:
            return [list(zip(starts, counts))]
        # each piece is at most ceil(count/K) elements: that is <= total/K + size elements per chunk
        room = limit - self.size * itemsize
        k = -(-total // room)
        steps = [-(-c // k) for c in counts]
        return [[(s + min(c, i * st), min(c, (i + 1) * st) - min(c, i * st)) for s, c, st in zip(starts, counts, steps)]
                for i in range(k)]

    # ---- synchronisation -------------------------------------------------------------------------------------

    def _barrier(self, what, offset=None, signature=None):
        """Publish that this rank reached the next sync point (and, with `offset`, where its data is), then wait
        for every rank (FlagBarrier: its Win.Sync orders the offset and signature before the flag)."""
        words, line = self._words, self.rank * LINE_INT64
        if offset is not None:
            words[line + _OFFSET] = offset
        if signature is not None:
            at = line + _signature_word(self._flags.count + 1)
            for i, value in enumerate(signature):
                words[at + i] = value
        self._flags.arrive(what)

    def _check_signatures(self, mine):
        """Right after the first barrier every rank sees every rank's signature; on any difference they all
        raise together (so they stay in step) instead of reducing each other's unrelated buffers."""
        words, start = self._words, _signature_word(self._flags.count)
        theirs = [[words[p * LINE_INT64 + start + i] for i in range(_SIGNATURE_WORDS)] for p in range(self.size)]
        if all(signature == mine for signature in theirs):
            return
        described = "; ".join(f"rank {p}: {_KINDS.get(k % 256, k % 256)} of {b} bytes in {k // 256}-byte elements, "
                              f"block-count checksum {c}" for p, (k, b, c) in enumerate(theirs))
        raise TransportError(f"rank {self.rank}: ranks disagree on the shm collective they are running: {described}")

    # ---- collectives -----------------------------------------------------------------------------------------

    def allreduce(self, buf, op):
        if 0 < buf.nbytes <= SMALL_BYTES and self.size > 1:
            self._small_allreduce(buf, ops.as_op(op))
            return
        self._collective(buf, even_counts(buf.size, self.size), ops.as_op(op), reduce=True, gather=True, kind=1)

    def reducescatter(self, buf, counts, op):
        self._collective(buf, counts, ops.as_op(op), reduce=True, gather=False, kind=2)

    def allgather(self, buf, counts):
        self._collective(buf, counts, None, reduce=False, gather=True, kind=3)

    def allreduce_out(self, src, dst, op, scale=1.0):
        """dst <- scale * (src reduced over all ranks), src untouched. The copy-in is only the blocks peers read,
        the owner reduces its block from src and the peers' regions straight into dst, scales it while the piece is
        in cache, and pushes it; the copy-out is only the other blocks. For 2 ranks that is one pass over the data
        in all, where pack + in-region allreduce + unpack costs two."""
        op = ops.as_op(op)
        if self.size == 1 or src.size == 0:
            ops.scale_into(dst, src, scale)
        elif src.nbytes <= SMALL_BYTES:
            self._small_allreduce(src, op, dst, scale)
        elif dst is not src and self._offset_in_region(src) is not None:
            # the input is a shared_array(), the result is not: reduce in place in dst
            dst[...] = src
            self.allreduce_out(dst, dst, op, scale)
        else:
            # in place, both private, or the result a shared_array() (a flat gradient bucket) and the input ordinary
            # memory (fresh gradients): then _collective copies into dst only the blocks peers read and reduces
            # this rank's block from src straight into dst -- half a copy less than copying src in first, 2 ranks
            self._collective(src, even_counts(src.size, self.size), op, reduce=True, gather=True, kind=1, out=dst,
                             scale=scale)

    def allreduce_segments(self, src, dst, op, scale=1.0):
        """allreduce_out for Segments (dst is src, or laid out alike): the arrays are read and written where they
        lie, so only the blocks peers read are copied in and only the blocks they reduced are copied out -- for 2
        ranks half the data each way, where packing into the region and unpacking copies all of it twice. Measured
        at 2 ranks on 3.7 MB in 8 arrays: 0.31 ms instead of 0.53 packed. Where dst's arrays lie back to back in
        our region (a flat gradient bucket's views), the result is reduced into them as one buffer of the region
        (as allreduce_out into a shared_array()), so nothing is copied out. Small ones (the one-barrier path), a
        set of one rank and other arrays that lie in the region are packed (the default)."""
        if self.size == 1 or src.nbytes <= SMALL_BYTES or not src.same_layout(dst) or self._holds_any(src):
            super().allreduce_segments(src, dst, op, scale)
            return
        out = dst
        if dst is not src and self._holds_any(dst):
            out = self._run_in_region(dst)
            if out is None:
                super().allreduce_segments(src, dst, op, scale)
                return
        self._collective(src, even_counts(src.size, self.size), ops.as_op(op), reduce=True, gather=True, kind=1,
                         out=out, scale=scale)

    def _holds_any(self, segments):
        return any(self.holds(a) for a in segments.arrays if a.size)

    def _run_in_region(self, segments):
        """The flat array of our region that segments' arrays are, back to back; None unless they are exactly that."""
        arrays = [(start, a) for start, a in zip(segments.starts, segments.arrays) if a.size]
        begin = self._start(arrays[0][1]) - arrays[0][0] * segments.itemsize
        if not self._in_region(begin, segments.nbytes) or any(
                self._start(a) != begin + start * segments.itemsize for start, a in arrays):
            return None
        return self._data[self.rank][begin: begin + segments.nbytes].view(segments.dtype)

    def reducescatter_out(self, src, dst, counts, op):
        """Block `rank` of dst <- that block of src reduced over all ranks; src untouched, dst's other blocks
        unspecified. src is read directly: the copy-in is only the blocks peers read, and the owner reduces from
        src and the peers' regions straight into dst (a reducescatter on a copy of src costs a full pass more).
        Buffers inside the shared region are copied to dst and reduced there in place."""
        op = ops.as_op(op)
        if dst is src:
            self.reducescatter(dst, counts, op)
        elif self.size == 1 or self._offset_in_region(src) is not None or self._offset_in_region(dst) is not None:
            dst[...] = src
            self.reducescatter(dst, counts, op)
        else:
            self._collective(src, counts, op, reduce=True, gather=False, kind=2, out=dst)

    def _collective(self, buf, counts, op, reduce, gather, kind, out=None, scale=1.0):
        self.check_counts(buf, counts)
        if self.size == 1 or buf.size == 0:
            return
        r, n, itemsize = self.rank, self.size, buf.itemsize
        out = buf if out is None else out
        # a buffer in our region is used where it lies (only one that fits the region can lie there)
        in_region = self._offset_in_region(buf) if buf.nbytes <= self.capacity else None
        peers = [(r + i) % n for i in range(1, n)]       # ring order from r+1 spreads the readers
        direct = None                                    # where our result lies in our region, when it does
        if out is not buf:
            direct = self._offset_in_region(out)
            if in_region is not None or (direct is not None and not (reduce and gather)):
                raise ValueError(f"rank {r}: an out-of-place shm collective takes its input outside the shared "
                                 f"region, and only an allreduce's result inside it")
        ufunc = ops.UFUNCS[op] if reduce else None
        signature = [kind + 256 * itemsize, buf.nbytes, sum((i + 1) * c for i, c in enumerate(counts)) % (1 << 62)]
        # Private data passes the region in cache-sized chunks, packed at its start; a result that lies in the
        # region (direct) takes the same chunks, each copied in from buf to the result's own place, reduced and
        # pushed there, with no copy-out. A buffer reduced in place in the region is used where it lies, in one
        # chunk -- unless a peer runs chunks: then it runs the same chunks (learnt at the first barrier, from the
        # peer's published offset, negative for chunked ranks: _PRIVATE, or _direct(offset); a chunked rank's
        # copy-in of chunk 0 needs no more than that chunk's bounds, which every rank computes alike).
        chunks = self._chunks(counts, itemsize) if in_region is None else [list(zip(offsets(counts), counts))]
        # An allreduce of private float data into a private result (out of place) of STREAM_BYTES or more writes
        # the result with non-temporal stores (stream_copy.py): an ordinary store reads every line of it in first,
        # which in place (its lines just read as the input) costs nothing and here a third more memory traffic
        streamed = (self._stream and reduce and gather and out is not buf and in_region is None
                    and ufunc is np.add and stream_copy.reduces(out.dtype) and out.nbytes >= stream_copy.STREAM_BYTES
                    and isinstance(out, np.ndarray) and isinstance(buf, np.ndarray)
                    and out.__array_interface__["data"][0] % out.itemsize == 0)
        # A result in the region gets its copy-in streamed too: its lines were not read, and the peer reading
        # them from memory costs less than this rank reading them in before it overwrites them
        # (An in-place call's copy-out is NOT streamed: its lines were read at this chunk's copy-in and are still
        # cached, so streaming them only evicts them. Tried at 2 ranks, same job, quiet: 4 MB 1.32x, 16 MB 1.06x,
        # 48 MB 1.07x the ordinary copy-out.)
        stream_in = streamed and direct is not None
        number = 0
        while number < len(chunks):
            chunk = chunks[number]
            packed = offsets([c for _, c in chunk])

            def mine(p, array=buf):
                s, c = chunk[p]
                return array[s: s + c]

            def region(q, p, base):
                """Block p of this chunk in rank q's region: packed at the start, or where q's buffer lies."""
                lo = packed[p] * itemsize if base == _PRIVATE else base + chunk[p][0] * itemsize
                return self._data[q][lo: lo + chunk[p][1] * itemsize].view(buf.dtype)

            if in_region is None:           # copy-in of what peers will read from us
                at = _PRIVATE if direct is None else direct
                for p in range(n):
                    if (p != r and reduce) or (p == r and not reduce):
                        if stream_in:
                            stream_copy.copy(region(r, p, at), mine(p))
                        else:
                            fill(region(r, p, at), mine(p))
            self._barrier("ready", signature=signature, offset=in_region if in_region is not None else
                          _PRIVATE if direct is None else _direct(direct))
            words = [self._words[p * LINE_INT64 + _OFFSET] for p in range(n)]
            bases = [w if w >= _PRIVATE else _direct(w) for w in words]
            if number == 0:
                self._check_signatures(signature)
                if in_region is not None and min(words) < 0:
                    chunks = self._chunks(counts, itemsize)
                    chunk = chunks[0]
                    packed = offsets([c for _, c in chunk])
            number += 1

            if reduce:
                # Block r: in every region these positions are read and written by this rank only, so it can
                # reduce them and push the result straight into every peer's region, piece by piece while the
                # piece is still in cache -- no barrier between reducing and gathering.
                own, result = mine(r), mine(r, out)
                sources = [region(q, r, bases[q]) for q in peers]
                for lo, hi in runs(own, self.cache_piece_bytes // itemsize):   # Segments: never across arrays
                    if streamed:    # the same adds and scale in one native pass; the result's lines streamed
                        stream_copy.reduce_push(result[lo:hi], own[lo:hi], [s[lo:hi] for s in sources], scale)
                        continue
                    acc = result[lo:hi]
                    ufunc(own[lo:hi], sources[0][lo:hi], out=acc)
                    for src in sources[1:]:
                        ufunc(acc, src[lo:hi], out=acc)
                    if scale != 1.0:
                        ops.scale_into(acc, acc, scale)
                    if gather:
                        for dst in sources:
                            dst[lo:hi] = acc
                if not gather:
                    self._barrier("reduce-scatter done")     # peers have stopped reading our region
                    continue
                self._barrier("allreduce done")              # every owner has pushed its block to us
                if in_region is None and direct is None:
                    for p in peers:
                        if streamed:
                            stream_copy.copy(mine(p, out), region(r, p, _PRIVATE))
                        else:
                            fill(mine(p, out), region(r, p, _PRIVATE))
                continue
            for p in peers:
                mine(p)[...] = region(p, p, bases[p])
            self._barrier("allgather done")

    def _small_allreduce(self, buf, op, out=None, scale=1.0):
        out = buf if out is None else out
        parity = self._small_calls % 2
        self._small_calls += 1
        nbytes, dtype = buf.nbytes, buf.dtype
        # the signature travels in the slot: a peer may already be writing its NEXT call's flag-line signature
        signature = np.array([4, nbytes, buf.itemsize, int(op)], dtype=np.int64)
        mine = self._small_slots[self.rank][parity]
        mine[:32].view(np.int64)[:] = signature
        mine[LINE:LINE + nbytes].view(dtype)[...] = buf
        self._barrier("ready")
        slots = [self._small_slots[p][parity] for p in range(self.size)]
        signatures = np.stack([slot[:32].view(np.int64) for slot in slots])
        if not (signatures == signature).all():
            described = "; ".join(f"rank {p}: {_KINDS.get(int(k), k)} of {int(b)} bytes in {int(i)}-byte elements"
                                  for p, (k, b, i, _) in enumerate(signatures.tolist()))
            raise TransportError(f"rank {self.rank}: ranks disagree on the shm collective they are running: "
                                 f"{described}")
        data = [slot[LINE:LINE + nbytes].view(dtype) for slot in slots]
        # every rank reduces in rank order, so every rank computes bitwise the same result
        ops.reduce_in_rank_order(out, data, op, scale)

    def close(self):
        """Collective: frees the window (every staging buffer handed out becomes invalid) and communicators."""
        if self._closed:
            return
        self._closed = True
        self._data = self._flags = self._small_slots = self._words = None
        self._last_in_region = (_NOTHING, None)
        # an array from shared_array() or result_window() may still be in use: freeing would turn it into a dangling
        # pointer, so then every rank keeps the window (the decision is collective: Win.Free is)
        keep = self._node.allreduce(self._pool_next > self._pool_start or self._results_taken, op=MPI.LOR)
        if keep:
            log.info("rank %d: shared arrays were handed out; the shm window stays mapped until exit", self.rank)
        else:
            self._win.Unlock_all()
            self._win.Free()
        self._node.Free()
        self._wire.free()
        if self.comm != MPI.COMM_WORLD:
            self.comm.Free()
