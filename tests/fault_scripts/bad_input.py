"""Bad input never breaks the job: each case raises a clear error on the calling rank, and a correct
collective still works afterwards. Every rank runs every case, so the job stays in step."""
import sys

import numpy as np

import ringtrain as rt
from _common import caught, check_usable, say

expected = 0

def expect(case, error_types, call):
    global expected
    try:
        call()
    except error_types as e:
        caught(case, e)
        expected += 1
    except Exception as e:   # the wrong kind of error is a failure, reported with its type
        say(f"WRONG ERROR[{case}] {type(e).__name__}: {e}")
    else:
        say(f"NO ERROR[{case}]")

expect("before_init", rt.NotInitializedError, lambda: rt.allreduce(np.ones(3, np.float32)))
rt.init()
expect("non_contiguous", (rt.RingtrainError, ValueError, TypeError),
       lambda: rt.allreduce(np.ones((4, 6), np.float32)[:, ::2], name="bad.noncontig"))
check_usable("noncontig")
expect("complex64", (rt.UnsupportedDtypeError, TypeError),
       lambda: rt.allreduce(np.ones(3, np.complex64), name="bad.complex"))
check_usable("complex")
expect("root_too_big", (rt.RingtrainError, ValueError),
       lambda: rt.broadcast(np.ones(3, np.float32), root_rank=rt.size(), name="bad.root"))
check_usable("root")
expect("bool_sum", (rt.UnsupportedDtypeError, TypeError),
       lambda: rt.allreduce(np.ones(3, np.bool_), op=rt.Sum, name="bad.boolsum"))
check_usable("boolsum")
rt.shutdown()
expect("after_shutdown", rt.NotInitializedError, lambda: rt.allreduce(np.ones(3, np.float32)))
say(f"EXPECTED {expected}")
sys.exit(0 if expected == 6 else 4)
