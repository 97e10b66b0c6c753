"""ringtrain for JAX, with Horovod's names: collectives on jax.Arrays and pytrees, eagerly and inside jax.jit.

    import ringtrain.jax as hvd
    hvd.init()
    tx = hvd.DistributedOptimizer(optax.adam(1e-3 * hvd.size()))   # averages gradients in buckets, then Adam
    params = hvd.broadcast_variables(params, root_rank=0)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, x, y):
        grads = jax.grad(loss)(params, x, y)                         # this rank's gradient
        updates, opt_state = tx.update(grads, opt_state, params)     # averaged over all ranks inside
        return optax.apply_updates(params, updates), opt_state

Run with `mpirun -np 4 python train.py` (or ringtrain-run). Every collective is a JAX primitive with an ordered
effect (host_call.py), so collectives run in program order on every rank, inside jit, grad and control flow, and
are differentiable with Horovod's gradient rules (one module per collective says its rule).
"""
from ringtrain.core.collectives import allgather_object, barrier, broadcast_object, join  # noqa: F401
from ringtrain.core.state import (cross_rank, cross_size, init, is_initialized, local_rank,  # noqa: F401
                                  local_size, rank, shutdown, size)
from ringtrain.errors import (RankFailureError, RingtrainError, StallError, TensorMismatchError,  # noqa: F401
                              UnsupportedDtypeError)
from ringtrain.ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum  # noqa: F401
from ringtrain.core.process_sets import (ProcessSet, add_process_set, global_process_set,  # noqa: F401
                                    remove_process_set)

from ringtrain.core.observe import dump_flight_recorder, straggler_report  # noqa: F401
from .allgather import allgather, grouped_allgather  # noqa: F401
from .allreduce import allreduce, grouped_allreduce  # noqa: F401
from .alltoall import alltoall  # noqa: F401
from .broadcast import broadcast, broadcast_variables  # noqa: F401
from .compression import Compression  # noqa: F401
from .optimizer import DistributedOptimizer  # noqa: F401
from .reducescatter import grouped_reducescatter, reducescatter  # noqa: F401

