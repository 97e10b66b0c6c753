"""Short randomized soak (the long one: `mpiexec -n 4 python tests/soak.py --soak --ops 10000`).

Hypothesis draws each program, derandomized so every rank draws the same one. Whether an example passed is
agreed over mpi4py (not ringtrain) before asserting, so all ranks fail, shrink and replay together.
"""
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ringtrain as rt

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import soak  # noqa: E402  (tests/soak.py: program generator, executor and numpy references)

pytestmark = pytest.mark.mpi(min_size=2)


@pytest.fixture(scope="module")
def soak_engine():
    """Small fusion threshold and segments, so fused buckets, over-threshold tensors and pipelining all occur."""
    was = rt.is_initialized()
    rt.shutdown()
    rt.init(**soak.SOAK_CONFIG)
    yield
    rt.shutdown()
    if was:
        rt.init()


class HypothesisChooser:
    """The program's choices drawn from hypothesis, so a failure shrinks to a small program."""

    def __init__(self, data):
        self.data = data

    def choice(self, options):
        return self.data.draw(st.sampled_from(list(options)))

    def integer(self, low, high):
        return self.data.draw(st.integers(low, high))


def _agreed(ok):
    from mpi4py import MPI
    return MPI.COMM_WORLD.allreduce(0 if ok else 1, op=MPI.SUM) == 0


@settings(derandomize=True, database=None, max_examples=8, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_random_programs_match_numpy(soak_engine, data):
    program = soak.random_program(HypothesisChooser(data), rt.size(), n_ops=24)
    messages = []
    ran, wrong = soak.run_program(rt, program, log=messages.append)
    assert ran == 24
    assert _agreed(wrong == 0), f"rank {rt.rank()}: {wrong} wrong of {ran}: {messages[:3]}"


def test_seeded_run_covers_every_kind_async_and_empty(soak_engine):
    program = soak.random_program(soak.NumpyChooser([7, rt.size()]), rt.size(), n_ops=120)
    specs = [spec for batch in program["batches"] for spec in batch["ops"]]
    assert {s["kind"] for s in specs} == set(soak.KINDS)
    assert any(b["async"] and len(b["ops"]) > 1 for b in program["batches"])
    assert any(s["count"] == 0 for s in specs) and any(s["count"] * 3 * 8 > soak.SOAK_CONFIG["fusion_threshold"]
                                                       for s in specs)
    messages = []
    ran, wrong = soak.run_program(rt, program, log=messages.append)
    assert ran == 120
    assert _agreed(wrong == 0), messages[:3]


def test_checker_catches_a_wrong_result(soak_engine):
    """The reference comparison itself must be able to fail: corrupt one element of each kind of result."""
    size, rank = rt.size(), rt.rank()
    for kind in soak.KINDS:
        spec = {"id": 0, "kind": kind, "dtype": "float32", "op": "Sum", "name": None, "count": 5, "cols": 1,
                "scales": (1.0, 1.0), "in_place": False, "members": 1, "first_dims": [2] * size, "root": 0,
                "splits": [[1] * size for _ in range(size)]}
        call = soak.Call(rt, 1, spec, rank, size)
        right = call.run_sync()
        assert call.check(right)[0] == 0, kind
        if kind == "grouped_allreduce":
            wrong = [right[0].copy()]
            wrong[0][0] += 1
        elif kind == "alltoall":
            wrong = (right[0].copy(), right[1])
            wrong[0][0] += 1
        else:
            wrong = right.copy()
            wrong.reshape(-1)[0] += 1
        assert call.check(wrong)[0] == 1, kind
    assert np.dtype(soak._dtype("bfloat16")).itemsize == 2
