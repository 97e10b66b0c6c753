"""A stall leaves the job usable. Case `skip`: the last rank skips one allreduce, then every rank runs ten more.
Case `diverge`: the last rank names that allreduce differently, then every rank runs ten more. Run with numpy
arrays, torch tensors and TensorFlow tensors, eagerly and in a tf.function (argv[1] picks: numpy | torch |
tensorflow), with the fault tests' short stall timeout.

Every rank that called the stalled collective gets a StallError naming the tensor and the ranks; a rank that
skipped it is told in its log (it has no call of its own that failed), and the ten that follow are correct on every
rank."""
import logging
import sys

import numpy as np
from mpi4py import MPI

import ringtrain as rt
from _common import caught, say, wait_for_stall_warning


class Said(logging.Handler):
    def emit(self, record):
        if record.levelno >= logging.ERROR and "stall" in record.getMessage():
            say(f"LOGGED {record.getMessage()}")


logging.getLogger("ringtrain").addHandler(Said())
framework = sys.argv[1]
# the framework is imported before init(), and the ranks meet in an MPI barrier (no stall timeout) before their first
# collective: importing TensorFlow takes seconds, and one rank's import finishing more than the short stall timeout
# after the other's stalled the first collective (seen under load)
if framework == "torch":
    import torch
    import ringtrain.torch as hvd

    def allreduce(x, name):
        return hvd.allreduce(torch.from_numpy(x), op=hvd.Sum, name=name).numpy()
elif framework == "tensorflow":
    import tensorflow as tf
    import ringtrain.tensorflow as hvd

    @tf.function(reduce_retracing=True)
    def traced(x, name):
        return hvd.allreduce(x, op=hvd.Sum, name=name)

    def allreduce(x, name):
        # the stalled calls and the unnamed ones eagerly, the named ones after them in a tf.function (the
        # asynchronous graph op)
        if name is None or name.endswith((".stalled", ".other")):
            return hvd.allreduce(tf.constant(x), op=hvd.Sum, name=name).numpy()
        return traced(tf.constant(x), name).numpy()
else:
    def allreduce(x, name):
        return rt.allreduce(x, op=rt.Sum, name=name)

rt.init()
MPI.COMM_WORLD.Barrier()
odd = rt.rank() == rt.size() - 1
want = np.full(6, rt.size() * (rt.size() + 1) / 2, np.float32)
for case in ("skip", "diverge"):
    rt.barrier()
    if odd and case == "skip":
        # the skipped call must be the older of the two waiting names (the stall ends the oldest): the skipping rank
        # submits its next call once the stall warning says the coordinator holds the skipped one (a pause would
        # only make that likely: under load the others could submit it later still)
        wait_for_stall_warning("skip.stalled")
    try:
        if not odd:
            allreduce(np.ones(6, np.float32), f"{case}.stalled")
        elif case == "diverge":
            allreduce(np.ones(6, np.float32), f"{case}.other")
    except rt.StallError as e:
        caught(case, e)
    for i in range(10):
        name = f"{case}.after{i}" if i % 2 else None          # named and unnamed
        try:
            got = allreduce(np.full(6, rt.rank() + 1.0, np.float32), name)
        except rt.RingtrainError as e:
            say(f"FAILED {case} after {i}: {type(e).__name__}: {e}")
            sys.exit(4)
        if not np.array_equal(got, want):
            say(f"WRONG {case} after {i}: {got}")
            sys.exit(5)
    say(f"TEN CORRECT {case}")
rt.shutdown()
say("DONE")
