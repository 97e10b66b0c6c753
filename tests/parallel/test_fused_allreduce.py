"""Many tensors in one fused allreduce on 2+ ranks of one node: pack, scale (prescale, postscale, Average's 1/N) and
unpack, against numpy.

A one-process run skips all of this (size 1 never packs), so these are the tests that see a tensor packed at the
wrong offset, a scale applied to the wrong bucket or twice, or requests with different ops or scales fused into one
bucket. Public API only: the engine may make a group one request or many, and fuse as it likes.
"""
import numpy as np
import pytest

import ringtrain as rt

pytestmark = pytest.mark.mpi(min_size=2)

# empty, scalar-like, prime, 2-D, a zero-size middle dim, and one tensor larger than the fusion threshold below;
# "large" adds a tensor that takes a group past shm's one-barrier small path (64 KB) and past its shared region
# (the fusion threshold), so the chunked reduce-scatter/allgather path runs too
SHAPES = {"small": [(0,), (1,), (7,), (3, 5), (2, 0, 3), (4099,), (33, 64), (5,)]}
SHAPES["large"] = SHAPES["small"][:3] + [(20011,)] + SHAPES["small"][3:]
FUSION_BYTES = 16 << 10
# (op, prescale, postscale): powers of two keep the scaling exact
CASES = [(rt.Average, 1.0, 1.0), (rt.Average, 2.0, 0.25), (rt.Sum, 1.0, 1.0), (rt.Sum, 0.5, 4.0),
         (rt.Max, 2.0, 1.0), (rt.Min, 1.0, 0.5)]


@pytest.fixture(scope="module", params=["shm", "mpi"])
def transport(request):
    """Small fusion buffer and segments: several buckets per group, chunked shm, several ring segments."""
    was = rt.is_initialized()
    rt.shutdown()
    rt.init(transport=request.param, segment_bytes=4096, fusion_threshold=FUSION_BYTES)
    yield request.param
    rt.shutdown()
    if was:
        rt.init()


def rank_inputs(rank, salt, dtype=np.float64, sizes="small"):
    rng = np.random.default_rng([rank, salt])
    return [rng.standard_normal(shape).astype(dtype) for shape in SHAPES[sizes]]


def reference(salt, op, prescale, postscale, dtype=np.float64, sizes="small"):
    n = rt.size()
    stacks = [np.stack([rank_inputs(r, salt, dtype, sizes)[i].astype(np.float64) * prescale for r in range(n)])
              for i in range(len(SHAPES[sizes]))]
    reduce = {rt.Average: np.sum, rt.Sum: np.sum, rt.Max: np.max, rt.Min: np.min}[op]
    divisor = n if op == rt.Average else 1
    return [reduce(s, axis=0) * postscale / divisor for s in stacks]


def check(got, want, what, rtol=1e-12):
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, f"{what}: tensor {i} has shape {g.shape}, expected {w.shape}"
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol, err_msg=f"{what}: tensor {i} of shape {w.shape}")


@pytest.mark.parametrize("sizes", sorted(SHAPES))
@pytest.mark.parametrize("case", range(len(CASES)))
def test_grouped_allreduce_packs_scales_and_unpacks(transport, case, sizes):
    op, prescale, postscale = CASES[case]
    mine = rank_inputs(rt.rank(), case, sizes=sizes)
    before = [a.copy() for a in mine]
    got = rt.grouped_allreduce(mine, op=op, prescale_factor=prescale, postscale_factor=postscale,
                               name=f"fused.{case}.{sizes}")
    check(got, reference(case, op, prescale, postscale, sizes=sizes),
          f"{sizes} {op.name} x{prescale} x{postscale} on {transport}")
    for a, b in zip(mine, before):
        np.testing.assert_array_equal(a, b)       # out of place: the inputs are untouched


def test_concurrent_groups_with_different_ops_and_scales_are_not_mixed(transport):
    """Every case in flight at once (plus a float32 group between them): each must come back with its own op and
    scales, whatever the engine fuses together."""
    handles = []
    for case, (op, prescale, postscale) in enumerate(CASES):
        handles.append(rt.grouped_allreduce_async(rank_inputs(rt.rank(), 100 + case), op=op, name=f"mixed.{case}",
                                                  prescale_factor=prescale, postscale_factor=postscale))
        if case == 2:
            handles.append(rt.grouped_allreduce_async(rank_inputs(rt.rank(), 99, np.float32), op=rt.Average,
                                                      name="mixed.float32"))
    single = rt.allreduce_async(rank_inputs(rt.rank(), 98)[6], op=rt.Sum, postscale_factor=0.5, name="mixed.one")
    results = [h.wait(timeout=60) for h in handles]
    float32 = results.pop(3)
    for case, (op, prescale, postscale) in enumerate(CASES):
        check(results[case], reference(100 + case, op, prescale, postscale), f"mixed case {case} on {transport}")
    check(float32, reference(99, rt.Average, 1.0, 1.0, np.float32), f"float32 group on {transport}", rtol=1e-5)
    check([single.wait(timeout=60)], [reference(98, rt.Sum, 1.0, 0.5)[6]], f"single tensor on {transport}")


@pytest.mark.parametrize("round_", [1, 2])
def test_small_tensors_in_flight_together_keep_their_own_op_and_scales(transport, round_):
    """Small enough to share one fusion bucket: they may be fused only with tensors that reduce the same way. Two
    rounds with the same names: the first is negotiated, the second takes whatever cached path the engine has."""
    handles = [rt.allreduce_async(rank_inputs(rt.rank(), 200 + case)[2], op=op, name=f"small.{case}",
                                  prescale_factor=prescale, postscale_factor=postscale)
               for case, (op, prescale, postscale) in enumerate(CASES)]
    for case, ((op, prescale, postscale), handle) in enumerate(zip(CASES, handles)):
        check([handle.wait(timeout=60)], [reference(200 + case, op, prescale, postscale)[2]],
              f"round {round_}, small tensor of case {case} on {transport}")


def test_in_place_group_with_averaging_and_scales(transport):
    mine = rank_inputs(rt.rank(), 7)
    handle = rt.grouped_allreduce_async(mine, op=rt.Average, prescale_factor=4.0, postscale_factor=0.5,
                                        name="fused.inplace", outs=mine)
    got = handle.wait(timeout=60)
    assert all(g is a for g, a in zip(got, mine))
    check(mine, reference(7, rt.Average, 4.0, 0.5), f"in place on {transport}")
