"""The last rank names its tensor differently: neither name is ready everywhere, so no rank can tell it from a
skipped step. Every rank must get a StallError (after RINGTRAIN_STALL_TIMEOUT_S) naming the tensors and the
missing ranks -- the older side first, the other side one timeout later -- and the next collective must work."""
import sys
import time

import numpy as np

import ringtrain as rt
from _common import caught, check_usable, say

rt.init()
name = "grad.b" if rt.rank() == rt.size() - 1 else "grad.a"
rt.barrier()
if name == "grad.b":
    time.sleep(1.0)     # grad.a is the older side, whatever the load (the test checks which side ends first)
try:
    rt.allreduce(np.ones(8, np.float32), op=rt.Sum, name=name)
except rt.RingtrainError as e:
    caught("name", e)
else:
    say("NO ERROR for divergent name")
    sys.exit(3)
check_usable()
rt.shutdown()
