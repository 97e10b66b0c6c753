"""The check the TF and JAX eager-path tests share (tests/parallel_tf/, tests/parallel_jax/): 4 MB eager results
come from the shm window's two slots, the framework adopts them without a copy, and a result the caller keeps holds
its slot, so later calls get the other slot or private memory and never overwrite it."""
import numpy as np

from ringtrain.core import state
from rank_data import data, total


def check_window_results_adopted(allreduce_sum, host_view, to_numpy, rank, size):
    """Six Sum allreduces of 4 MB of float32 (the window's smallest), results 0 and 3 kept.

    allreduce_sum(array) runs the framework's eager allreduce of a numpy array (as the framework's own tensor) with
    op=Sum; host_view(result) is the host memory the framework's result lies in, and to_numpy(result) its values."""
    n = 1 << 20
    transport = state.engine().transports["cpu"]
    mine, want = data(n, 0, rank), total(n, 0, size)     # call c adds c on every rank
    kept, placed = [], []
    for call in range(6):
        y = allreduce_sum(mine + call)
        placed.append(transport.holds(host_view(y)))
        np.testing.assert_array_equal(to_numpy(y), want + size * call, err_msg=f"rank {rank}: call {call}")
        if call in (0, 3):
            kept.append((call, y))
    for call, y in kept:
        np.testing.assert_array_equal(to_numpy(y), want + size * call, err_msg=f"rank {rank}: result {call} changed")
    if transport.name == "shm":
        # call 2 runs while call 0's result is kept and y holds call 1's; from call 4 on both slots are kept
        assert placed == [True, True, False, True, False, False], placed
