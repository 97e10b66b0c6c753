"""The engine's data model: what ranks agree on (Meta) and what the agreement tells every rank to do (Actions).

The agreement only decides; the executor alone reads and writes data. An Action is therefore a complete, typed
instruction: a Collective says which tensors, where their data comes from (the requests' own buffers, or the
copies every rank published in the agreement cycle's slots) and what multiplies the inputs and the result; the
other Actions are events (failed tensors, a warning, join finished, shutdown). Every rank receives
the same Actions in the same order and makes the same transport call for each.

No MPI and no numpy here: requests, the Coordinator and tests build these on any rank, without a communicator.
"""
import dataclasses
import enum
import zlib

from ..ops import DTYPES, ReduceOp, result_scale


@dataclasses.dataclass(frozen=True)
class Meta:
    """What every rank must agree on for one named collective."""
    kind: str                 # allreduce | allgather | broadcast | alltoall | reducescatter | barrier
    dtype: str = "uint8"
    shape: tuple = ()
    op: int = -1              # ReduceOp value, -1 where not a reduction
    root: int = -1
    device: str = "cpu"
    scales: tuple = (1.0, 1.0)   # prescale, postscale
    splits: tuple = ()        # alltoall: rows sent to each rank
    parts: tuple = ()         # grouped allreduce: element count of each tensor (shape is their total)

    @property
    def nbytes(self):
        n = 1
        for d in self.shape:
            n *= d
        return n * DTYPES[self.dtype].itemsize

    def describe(self):
        parts = [f"shape {self.shape} {self.dtype}"]
        if self.op >= 0:
            parts.append(f"op {ReduceOp(self.op).name.title()}")
        if self.root >= 0:
            parts.append(f"root {self.root}")
        if self.kind == "alltoall":
            parts.append(f"splits {list(self.splits)}")
        if self.device != "cpu":
            parts.append(f"on {self.device}")
        if self.scales != (1.0, 1.0):
            parts.append(f"scales {self.scales}")
        if self.parts:
            parts.append(f"in {len(self.parts)} tensors of {_sizes(self.parts)}")
        return f"{self.kind} " + " ".join(parts)


def express_eligible(meta):
    """The one rule for the fast paths: a host allreduce with no prescale. Such a collective may run in one
    agreement cycle on the caller's thread (Engine.express), travel in the cycle's slots (eager), and be reduced
    by the transport straight from its array into its output with no staging copy (Executor.allreduce_one): the
    prescale is the one thing those paths cannot apply, and device arrays take the device transport."""
    return meta.kind == "allreduce" and meta.device == "cpu" and meta.scales[0] == 1.0


def _sizes(parts, shown=6):
    """A grouped allreduce's element counts as ranks compare them: all of them when few, else the first and last
    few and a checksum of the whole list, so two ranks that split the same total differently never read alike."""
    if len(parts) <= shown:
        return ", ".join(map(str, parts)) + " elements"
    head, tail = parts[:shown // 2], parts[-(shown // 2):]
    checksum = zlib.crc32(",".join(map(str, parts)).encode())
    return f"{', '.join(map(str, head))}, ..., {', '.join(map(str, tail))} elements (checksum {checksum:08x})"


class Source(enum.Enum):
    """Where a collective's input data is."""
    BUFFERS = "buffers"       # the requests' own arrays (packed into the transport's staging buffer when fused)
    SLOTS = "slots"           # every rank's copy, published in the agreement cycle's slots (an eager allreduce)


@dataclasses.dataclass(frozen=True)
class Collective:
    """One agreed collective over one or more tensors (an allreduce bucket may fuse many)."""
    kind: str
    names: tuple
    metas: tuple
    prescale: float = 1.0     # multiplies the inputs
    scale: float = 1.0        # multiplies the result: the postscale, and 1/N for Average (Collective.of)
    first_dims: tuple = ()    # allgather: dim 0 of each rank's input
    splits: tuple = ()        # alltoall: each rank's splits
    source: Source = Source.BUFFERS
    # SLOTS: every rank's published copy, in rank order (views valid until this rank enters the next cycle)
    slots: tuple = dataclasses.field(default=(), compare=False, repr=False)

    @classmethod
    def of(cls, kind, names, metas, size, **fields):
        """The collective with the scale rule applied: what multiplies a reduction's inputs and its result on a
        communicator of `size` ranks (joined ranks included: they contribute zeros, as in DDP's join)."""
        meta = metas[0]
        if meta.op >= 0:
            prescale, postscale = meta.scales
            fields.setdefault("prescale", prescale)
            fields.setdefault("scale", result_scale(meta.op, postscale, size))
        return cls(kind, tuple(names), tuple(metas), **fields)

    @property
    def nbytes(self):
        return sum(m.nbytes for m in self.metas)


@dataclasses.dataclass(frozen=True)
class Failed:
    """These tensors end with an error on every rank that holds them (mismatch, a stall, a rank that shut down, join
    and a non-allreduce); every rank drops them, so the collectives after them agree as usual."""
    names: tuple
    error: str                # the ringtrain.errors class name
    message: str


@dataclasses.dataclass(frozen=True)
class Warn:
    message: str


@dataclasses.dataclass(frozen=True)
class JoinDone:
    rank: int                 # the rank that joined last


@dataclasses.dataclass(frozen=True)
class Shutdown:
    pass
