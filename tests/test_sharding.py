"""ShardPlan (who updates which elements in a sharded optimizer), without MPI."""
import random

import pytest

from ringtrain.reducer.sharding import Piece, ShardPlan, overlaps
from ringtrain.transports.base import even_counts


def covered(plan):
    """element (param, i) -> the ranks that own it."""
    owners = {}
    for rank in range(plan.size):
        for piece in plan.pieces(rank):
            for i in range(piece.start, piece.start + piece.length):
                owners.setdefault((piece.param, i), []).append(rank)
    return owners


@pytest.mark.parametrize("size", [1, 2, 3, 4, 7])
def test_every_element_has_exactly_one_owner_and_blocks_are_balanced(size):
    rng = random.Random(size)
    numels = [rng.choice([1, 2, 3, 5, 17, 100, 1001]) for _ in range(30)]
    bucket_of = sorted(rng.randrange(6) for _ in numels)
    bucket_of = [sorted(set(bucket_of)).index(b) for b in bucket_of]     # numbered 0.. without gaps
    plan = ShardPlan.build(numels, bucket_of, size)
    owners = covered(plan)
    assert sorted(owners) == sorted((p, i) for p, n in enumerate(numels) for i in range(n))
    assert all(len(ranks) == 1 for ranks in owners.values())
    owned = [plan.owned_numel(r) for r in range(size)]
    assert sum(owned) == sum(numels)
    assert max(owned) - min(owned) <= len(plan.buckets)      # balanced to one element per bucket


def test_blocks_follow_the_reducescatter_split_and_offsets_match_the_buffer():
    plan = ShardPlan([10, 7, 3], [[0, 1], [2]], 3)            # bucket 0: 17 elements, bucket 1: 3
    assert plan.buckets[0].blocks == tuple(even_counts(17, 3)) == (6, 6, 5)
    assert plan.buckets[1].blocks == (1, 1, 1)
    assert plan.pieces(0) == [Piece(0, 0, 6, 0, 0), Piece(2, 0, 1, 1, 0)]
    # rank 1's block of bucket 0 is elements 6..11: the last 4 of parameter 0 and the first 2 of parameter 1
    assert plan.pieces(1) == [Piece(0, 6, 4, 0, 6), Piece(1, 0, 2, 0, 10), Piece(2, 1, 1, 1, 1)]
    assert plan.pieces(2) == [Piece(1, 2, 5, 0, 12), Piece(2, 2, 1, 1, 2)]


def test_a_bucket_smaller_than_the_ranks_leaves_some_ranks_empty():
    plan = ShardPlan([2], [[0]], 4)
    assert [len(plan.pieces(r)) for r in range(4)] == [1, 1, 0, 0]


def test_overlaps_finds_the_old_pieces_of_a_new_range():
    old = ShardPlan([10, 7, 3], [[0, 1], [2]], 3)
    new = ShardPlan([10, 7, 3], [[2, 1, 0]], 2)               # other buckets and ranks: a resharded load
    for rank in range(2):
        for piece in new.pieces(rank):
            sources = [p for r in range(3) for p in old.pieces(r) if p.param == piece.param]
            parts = overlaps(sources, piece.start, piece.length)
            assert sum(count for *_, count in parts) == piece.length
            at = 0
            for source, offset, dst, count in parts:
                assert dst == at and source.start + offset == piece.start + dst
                at += count
    with pytest.raises(ValueError, match="cover"):
        overlaps([Piece(0, 0, 3, 0, 0)], 2, 4)


def test_bad_plans_are_refused():
    with pytest.raises(ValueError, match="exactly one bucket"):
        ShardPlan([1, 2], [[0]], 2)
    with pytest.raises(ValueError, match="at least one rank"):
        ShardPlan([1], [[0]], 0)
    with pytest.raises(ValueError, match="out of range"):
        ShardPlan([1], [[0]], 2).pieces(2)
