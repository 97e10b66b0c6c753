"""The express cycle's control plane in compiled code (csrc/express_cycle.c), for the shared-memory window exchange.

    native = NativeCycle.open(rank, size, header_bytes, bitmap_offset, published, slots)   # None: not available
    outcome = native.express(c, flags, cid, words, array, out, how, spin_s)                  # NOT_YET/DONE/ARRIVED
    pack((sources, sizes), out)                                        # a group's members into one packed array

One call does what WindowExchange.publish + gather and the eager reduce do in Python for one express allreduce:
fill this rank's slot of parity c % 2 (header, a bitmap with the one id, the eager data), publish cycle c, spin --
bounded by spin_s -- until every peer published c, and when every rank published c with no flag, the id ready and
the same eager (id, nbytes), reduce the slots in rank order into `out` (Sum; Average's scale after). Any other
outcome leaves exactly the state WindowExchange.publish would have left, so the Python logic goes on from there:
NOT_YET (a peer is not there yet: a caller with a core per rank first waits in further native rounds on that cycle,
express(..., None, out, ...), without the GIL and with the Watchdog's checks between them (CycleAgreement._native_wait);
then the Watchdog's bounded wait, with its stall timeout and error messages, takes over),
ARRIVED (everyone published; the agreement reads the snapshot and decides as after its own gather).
`how` (reduce_how(dtype, op, scale, size)) says how to reduce natively, or None for a dtype/op the C code does not
reduce (float16, bfloat16, small integers, Min, Max, Product): that outcome is then ARRIVED, and the executor
reduces from the slots as the Python path does.
pack (the module's pack_group) copies a small group's members -- input buffers, or int addresses the caller
vouches for, with their byte sizes -- back to back into one packed array, which is then reduced as any array is.

Memory ordering (as transports/shm.py argues the window's race-freedom). Writer: every store into our slot (header,
bitmap, data) precedes a release store of c into our published word, so a peer whose acquire load reads c (or later)
sees the whole slot. Reader: we read a peer's slot only after an acquire load of its published word returned >= c,
so we read its cycle-c slot complete. Reuse: a peer writes the slot of parity c % 2 again only in cycle c + 2, which
it enters only after it has read our cycle c + 1 slot, which we publish only after this call (and the reduce from
the slots in it) returned. The Python path's publish (Win.Sync, a full fence, then a plain store) and gather (plain
loads, then Win.Sync) are at least as strong, so ranks on either path read each other's slots safely; x86's stores
are not reordered with older stores and loads not with older loads, so there both are plain moves.
Bitwise: the C reduce adds element by element in rank order (s0 + s1, then + s2 ...) with no reassociation and no
contraction (-ffp-contract=off), and scales in a second pass as ops.scale_into does (float32 by the factor rounded to
float32; integers divide by N truncating toward zero): the same bits as ops.reduce_in_rank_order on every rank.

A tiny CPython extension module (not ctypes: ctypes needs each array's address from Python, ~1-2 us apiece;
the module takes the arrays through the buffer protocol), built on first use with the host's C compiler ($CC, else
cc) against this Python's headers into ringtrain's per-user cache, under a name that hashes the source, the Python
version and the command. Not available (RINGTRAIN_NATIVE=0, no compiler, or a build error): the exchange
runs the Python path, which computes the same results.
"""
import logging
import os
import shlex
import sys
import sysconfig

from .. import csrc

log = logging.getLogger("ringtrain")

SOURCE = "express_cycle.c"
ALSO = ("express_fast.c", "express_group.c", "express_ctx.h")   # compiled into the same module / included
NOT_YET, DONE, ARRIVED = 0, 1, 2
SPIN_S = 50e-6           # the native spin's bound; then the Watchdog waits (shorter than cycle_exchange.WAIT_FLOOR_S)

_F32, _F64, _I32, _I64 = 0, 1, 2, 3
_NATIVE_DTYPES = {"float32": _F32, "float64": _F64, "int32": _I32, "int64": _I64}
_SUM_OPS = (0, 1)        # ReduceOp.AVERAGE, ReduceOp.SUM: both sum, then scale


def compiler_command():
    return shlex.split(os.environ.get("CC", "cc")) + [
        "-O3", "-std=gnu11", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC", "-w",
        "-I" + sysconfig.get_paths()["include"]]


def _load():
    return csrc.load_extension("_express_cycle", csrc.built(SOURCE, compiler_command(), key=[sys.version],
                                                            suffix=sysconfig.get_config_var("EXT_SUFFIX"),
                                                            also=ALSO))


# the loaded extension module, or a str saying why it is not available (built once per process, on first use)
library = csrc.OnFirstUse(_load)


def reduce_how(dtype, op, scale, size):
    """(kind, scale, divisor) for rt_express's reduce of `dtype` (a ringtrain dtype name) under `op` with the result
    scale `scale`, or None when the C code does not reduce it (then the outcome is ARRIVED and Python reduces)."""
    code = _NATIVE_DTYPES.get(dtype)
    if code is None or int(op) not in _SUM_OPS:
        return None
    if scale == 1.0:
        return (code * 2, 1.0, 1)
    if code in (_I32, _I64):            # integers: only a factor 1/k (ops.scale_into's truncating divide by k)
        inv = round(1.0 / scale) if scale > 0 else 0
        if inv < 1 or abs(inv * scale - 1.0) >= 1e-12:
            return None
        return (code * 2 + 1, scale, inv)
    return (code * 2 + 1, scale, 1)


def pack(members, out):
    """A small group's (sources, sizes) back to back into `out` (a C-contiguous buffer of their total size): the
    packed input array of the Python path. Int addresses among the sources need the compiled module."""
    module = library()
    if isinstance(module, str):
        flat = memoryview(out).cast("B")
        offset = 0
        for source, nbytes in zip(*members):
            flat[offset:offset + nbytes] = memoryview(source).cast("B")
            offset += nbytes
        if offset != flat.nbytes:
            raise ValueError(f"a group's members have {offset} bytes, out {flat.nbytes}")
        return
    module.pack_group(members[0], members[1], out)


class NativeCycle:
    """One rank's handle on the compiled express cycle over one window's slots."""

    def __init__(self, module, ctx):
        self._ctx = ctx
        self._call = module.express

    @classmethod
    def open(cls, rank, size, header_bytes, bitmap_offset, published, slots):
        """published: each rank's published-word address; slots: each rank's two slot addresses (parity 0, 1).
        None (logged at DEBUG) when the module is not available."""
        module = library()
        if isinstance(module, str):
            log.debug("ringtrain: the native express cycle is not available (%s); the Python path runs", module)
            return None
        ctx = module.ctx_new(rank, size, header_bytes, bitmap_offset, tuple(published),
                             tuple(a for pair in slots for a in pair))
        return cls(module, ctx)

    def express(self, c, flags, cid, words, array, out, how, spin_s=SPIN_S):
        """Publish cycle c's slot with `array` as eager data, wait (bounded), and reduce into `out` when the
        snapshot allows (see the module docstring). `array` and `out`: C-contiguous buffers of equal length."""
        if how is None:
            return self._call(self._ctx, c, flags, cid, words, array, out, -1, 1.0, 1, int(spin_s * 1e9))
        return self._call(self._ctx, c, flags, cid, words, array, out, how[0], how[1], how[2], int(spin_s * 1e9))

    def close(self):
        self._ctx = None            # the capsule frees the context when the last reference goes
