"""The last rank names its tensor differently: neither name is ready everywhere, so no rank can tell it from a
skipped step. Every rank must get a StallError (after RINGTRAIN_STALL_TIMEOUT_S) naming the tensors and the
missing ranks -- the older side first, the other side one timeout later -- and the next collective must work."""
import sys

import numpy as np

import ringtrain as rt
from _common import caught, check_usable, say, wait_for_stall_warning

rt.init()
name = "grad.b" if rt.rank() == rt.size() - 1 else "grad.a"
rt.barrier()
if name == "grad.b":
    # grad.a is the older side, whatever the load (the test checks which side ends first): grad.b is submitted once
    # the stall warning says the coordinator holds grad.a. Early enough that grad.b has waited past the warning
    # threshold when grad.a's stall ends it, so that message names both sides (the test's short warning threshold)
    wait_for_stall_warning("grad.a")
try:
    rt.allreduce(np.ones(8, np.float32), op=rt.Sum, name=name)
except rt.RingtrainError as e:
    caught("name", e)
else:
    say("NO ERROR for divergent name")
    sys.exit(3)
check_usable()
rt.shutdown()
