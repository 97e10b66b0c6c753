"""ringtrain.jax's host-call primitive in one process: collectives inside one jitted function run on the host in
program order (the ordering token), even when their data does not depend on each other, and one whose result is
unused still runs."""
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray

from ringtrain.jax.host_call import collective_primitive

ran = []


def _record(*arrays, spec):
    ran.append((spec, threading.get_ident()))
    return [np.asarray(a) + 1 for a in arrays]


recorder_p = collective_primitive("test_recorder", _record, lambda *avals, spec: [ShapedArray(a.shape, a.dtype)
                                                                                   for a in avals])


def test_independent_collectives_run_in_program_order_on_one_thread():
    def many(x):
        return sum(recorder_p.bind(x * i, spec=i)[0] for i in range(16))
    for _ in range(3):
        ran.clear()
        out = jax.jit(many)(jnp.ones(100))
        np.testing.assert_array_equal(np.asarray(out), np.full(100, sum(i + 1 for i in range(16))))
        assert [spec for spec, _ in ran] == list(range(16))
        assert len({thread for _, thread in ran}) == 1


def test_a_collective_with_an_unused_result_still_runs_and_eagerly_too():
    ran.clear()
    jax.block_until_ready(jax.jit(lambda x: (recorder_p.bind(x, spec="unused"), x * 2)[1])(jnp.ones(3)))
    (eager,) = recorder_p.bind(jnp.arange(3.0), spec="eager")
    assert [spec for spec, _ in ran] == ["unused", "eager"]
    np.testing.assert_array_equal(np.asarray(eager), [1.0, 2.0, 3.0])
