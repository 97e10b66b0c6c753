"""Short randomized differential soak (the long one: `python benchmarks/soak.py`, or
`mpiexec -n 4 python tests/soak.py --soak --ops 10000`).

Hypothesis draws some programs, derandomized so every rank draws the same one; seeded programs run on the shm
transport, the mpi transport and two pretend nodes (RINGTRAIN_SOAK_SEED picks the seed; a failure names it and the
command that replays it). Whether a program passed is agreed over mpi4py (not ringtrain) before asserting, so all
ranks fail, shrink and replay together. The engine runs with a cache capacity of 32, so the programs' names churn far
past it.
"""
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import ringtrain as rt
from ringtrain.core import state

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


SEED = int(os.environ.get("RINGTRAIN_SOAK_SEED", "20261125"))
SEEDED_OPS = 200
CONFIGS = {"shm": {}, "mpi": {"transport": "mpi"}, "pretend-nodes": {"simulate_nodes": 2}}


@pytest.fixture(params=sorted(CONFIGS))
def soak_config(request):
    """The soak's engine settings on one transport / topology (restored afterwards)."""
    was = rt.is_initialized()
    rt.shutdown()
    rt.init(**soak.SOAK_CONFIG, **CONFIGS[request.param])
    yield request.param
    rt.shutdown()
    if was:
        rt.init()


def _world_ops(program):
    return sum(not spec["in_set"] for batch in program["batches"] for spec in batch["ops"])


def _agreed(ok):
    from mpi4py import MPI
    return MPI.COMM_WORLD.allreduce(0 if ok else 1, op=MPI.SUM) == 0


@settings(derandomize=True, database=None, max_examples=8, deadline=None,
          phases=[Phase.explicit, Phase.generate],     # no shrinking under MPI: the draws are printed
          suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_random_programs_match_numpy(soak_engine, data):
    program = soak.random_program(HypothesisChooser(data), rt.size(), n_ops=24)
    messages = []
    ran, wrong = soak.run_program(rt, program, log=messages.append)
    assert ran == _world_ops(program)          # without a process set its ops are left out
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
    assert ran == _world_ops(program) > 90
    assert _agreed(wrong == 0), messages[:3]


def test_the_workloads_that_broke_the_engine(soak_engine):
    """The issue's two loops, shortened: allgathers under a new name per batch with rank-dependent rows, and a
    random async mix with a new name per op -- far past the soak's cache capacity of 32."""
    wrong = soak.allgather_loop(rt, 60)[1] + soak.random_mix(rt, 40, seed=SEED)[1]
    assert _agreed(wrong == 0), f"rank {rt.rank()}: {wrong} wrong"
    assert len(state.engine().agreement.cache) <= soak.SOAK_CONFIG["cache_capacity"]


def test_checker_catches_a_wrong_result(soak_engine):
    """The reference comparison itself must be able to fail: corrupt one element of each kind of result."""
    size, rank = rt.size(), rt.rank()
    for kind in soak.KINDS:
        if kind == "barrier":
            continue
        spec = {"id": 0, "kind": kind, "dtype": "float32", "op": "Sum", "name": None, "count": 5, "cols": 1,
                "scales": (1.0, 1.0), "in_place": False, "shared": False, "tensors": 1, "first_dims": [2] * size,
                "root": 0, "splits": [[1] * size for _ in range(size)]}
        call = soak.Call(rt, 1, spec, rank, size)
        right = call.run_sync()
        assert call.check(right)[0] == 0, kind
        if kind in soak.GROUPED:
            wrong = [right[0].copy()]
            wrong[0].reshape(-1)[0] += 1
        elif kind == "alltoall":
            wrong = (right[0].copy(), right[1])
            wrong[0][0] += 1
        else:
            wrong = right.copy()
            wrong.reshape(-1)[0] += 1
        assert call.check(wrong)[0] == 1, kind
    assert np.dtype(soak._dtype("bfloat16")).itemsize == 2


def test_seeded_programs_match_numpy_on_every_transport(soak_config):
    """Every kind, grouped form, op and dtype; sizes past every eager and chunk limit; in-window and private
    arrays; name churn past the cache; set ops on the even ranks -- against numpy."""
    messages = []
    ran, wrong = soak.run_soak(rt, SEED, SEEDED_OPS, chunk=SEEDED_OPS, log=messages.append)
    replay = (f"replay: mpiexec -n {rt.size()} python tests/soak.py --seed {SEED} --ops {SEEDED_OPS} --chunk "
              f"{SEEDED_OPS} " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in CONFIGS[soak_config].items()))
    assert _agreed(wrong == 0), f"rank {rt.rank()}: {wrong} wrong of {ran} (seed {SEED}): {messages[:3]}\n{replay}"
