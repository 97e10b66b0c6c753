"""Which rank owns which elements of which parameter: the plan of a sharded optimizer (ZeRO stages 1 and 2).

Pure bookkeeping on sizes, framework-free, unit-tested without MPI. A bucket is a run of parameters laid back to
back in one flat buffer (the gradient bucket the binding reduces, the parameter bucket it allgathers). Each bucket is
split among the N ranks exactly as the core's reducescatter splits dim 0 (`even_counts`: as evenly as possible, the
first blocks one larger), so rank r's block of a reduce-scattered gradient bucket is the block of parameters it
updates, and the allgather of every rank's updated block, in rank order, is the whole bucket again.

Balanced by bytes: within every bucket the blocks differ by at most one element, whatever the parameter sizes, and
a parameter may be cut anywhere (a parameter that does not divide by N, or that straddles two blocks, is simply cut
into pieces). A rank's share of the optimizer state is the union of its blocks: 1/N of the model, to within one
element per bucket.

    plan = ShardPlan.build(numels=[10, 7, 3], bucket_of=[0, 0, 1], size=3)
    plan.pieces(rank)     # [Piece(param, start, length, bucket, offset), ...]: what `rank` updates
"""
import dataclasses

from ..transports.base import even_counts, offsets


@dataclasses.dataclass(frozen=True)
class Piece:
    """Elements [start, start + length) of parameter `param` (flattened), at `offset` in bucket `bucket`'s buffer."""
    param: int
    start: int
    length: int
    bucket: int
    offset: int


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Parameters `params` back to back (param i at `starts[i]`), `numel` elements, split into `blocks` by rank:
    rank r owns [block_starts[r], block_starts[r] + blocks[r])."""
    params: tuple
    starts: tuple
    numel: int
    blocks: tuple
    block_starts: tuple


class ShardPlan:
    """The buckets of a model's parameters and each rank's blocks of them, for `size` ranks."""

    def __init__(self, numels, buckets, size):
        if size < 1:
            raise ValueError(f"a shard plan needs at least one rank, got size={size}")
        seen = sorted(i for bucket in buckets for i in bucket)
        if seen != list(range(len(numels))):
            raise ValueError("every parameter must be in exactly one bucket")
        self.numels = tuple(int(n) for n in numels)
        self.size = size
        self.buckets = []
        self.bucket_of = [None] * len(numels)
        for b, params in enumerate(buckets):
            sizes = [self.numels[i] for i in params]
            blocks = even_counts(sum(sizes), size)
            self.buckets.append(Bucket(tuple(params), tuple(offsets(sizes)), sum(sizes), tuple(blocks),
                                       tuple(offsets(blocks))))
            for i in params:
                self.bucket_of[i] = b

    @classmethod
    def build(cls, numels, bucket_of, size):
        """A plan from each parameter's bucket number (buckets numbered 0.. in order, parameters kept in order)."""
        count = max(bucket_of, default=-1) + 1
        buckets = [[i for i, b in enumerate(bucket_of) if b == k] for k in range(count)]
        return cls(numels, buckets, size)

    def pieces(self, rank):
        """What `rank` owns, bucket by bucket, in buffer order: its block of each bucket, cut at parameter edges."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is out of range for a plan of {self.size} ranks")
        out = []
        for b, bucket in enumerate(self.buckets):
            lo = bucket.block_starts[rank]
            hi = lo + bucket.blocks[rank]
            for param, start in zip(bucket.params, bucket.starts):
                end = start + self.numels[param]
                a, z = max(lo, start), min(hi, end)
                if a < z:
                    out.append(Piece(param, a - start, z - a, b, a))
        return out

    def owned_numel(self, rank):
        return sum(bucket.blocks[rank] for bucket in self.buckets)

    def describe(self):
        """A picklable summary (numels and buckets) that rebuilds this plan: ShardPlan(*plan.describe(), size)."""
        return list(self.numels), [list(bucket.params) for bucket in self.buckets]


def overlaps(pieces, start, length):
    """Where elements [start, start + length) of one parameter come from, given `pieces` of it (any objects with
    .start and .length, e.g. another plan's Piece): a list of (piece, offset in piece, offset in the range, count),
    in range order. Raises ValueError when the pieces do not cover the range."""
    found, covered = [], 0
    for piece in sorted(pieces, key=lambda p: p.start):
        a, z = max(start, piece.start), min(start + length, piece.start + piece.length)
        if a < z:
            found.append((piece, a - piece.start, a - start, z - a))
            covered += z - a
    if covered != length:
        raise ValueError(f"pieces cover {covered} of the {length} elements from {start}")
    return found
