"""A desync for the flight recorder, once per framework named on the command line (numpy | torch | tensorflow:
the collectives go through that framework's binding), each in a fresh ringtrain world whose flight recorder writes
to <RINGTRAIN_FLIGHT_RECORDER_DIR>/<framework> (numpy: the directory itself, which ringtrain-run reports on).

Every rank runs three steps of two named allreduces, and the last rank skips 'step2.forward'. The others stall in
it (the fault tests' short stall timeout), every rank writes its flight recorder, and the job goes on: the skipping
rank waits for the stall warning of the collective it skipped before its next call, so the skipped collective is the
oldest waiting name and the stall ends it; the next one then completes everywhere."""
import os
import sys

import numpy as np

import ringtrain as rt
from _common import caught, say, wait_for_stall_warning

base = os.environ["RINGTRAIN_FLIGHT_RECORDER_DIR"]


def binding(framework):
    if framework == "torch":
        import torch
        import ringtrain.torch as hvd
        return lambda x, name: hvd.allreduce(torch.from_numpy(x), op=hvd.Sum, name=name).numpy()
    if framework == "tensorflow":
        import tensorflow as tf
        import ringtrain.tensorflow as hvd
        return lambda x, name: hvd.allreduce(tf.constant(x), op=hvd.Sum, name=name).numpy()
    return lambda x, name: rt.allreduce(x, op=rt.Sum, name=name)


for framework in sys.argv[1:]:
    allreduce = binding(framework)
    rt.init(flight_recorder_dir=base if framework == "numpy" else os.path.join(base, framework))
    skipper = rt.size() - 1
    for step in range(3):
        for part in ("forward", "grads"):
            name = f"step{step}.{part}"
            if rt.rank() == skipper and name == "step2.forward":
                # the desync: this rank skips a collective, and submits its next one once the stall warning says the
                # coordinator holds the skipped one (so that one is the oldest waiting name, whatever the load)
                wait_for_stall_warning(name)
                continue
            try:
                got = allreduce(np.ones(4, np.float32), name)
                if not np.array_equal(got, np.full(4, float(rt.size()), np.float32)):
                    say(f"WRONG {framework} {name}: {got}")
                    sys.exit(5)
            except rt.StallError as e:
                caught(f"{framework} {name}", e)
    say(f"DIR {framework} {rt.flight_recorder_dir()}")
    rt.shutdown()
say("DONE")
