"""The last rank submits tensor 'grad.w' with a divergent shape, dtype, op, root or collective kind.
Every rank must get TensorMismatchError naming the ranks and values, then a correct allreduce must still work.
Usage: mismatch.py shape|dtype|op|root|kind"""
import sys

import numpy as np

import ringtrain as rt
from _common import caught, check_usable, say

case = sys.argv[1]
rt.init()
odd = rt.rank() == rt.size() - 1
shape = (4, 3) if (odd and case == "shape") else (4, 4)
dtype = np.float64 if (odd and case == "dtype") else np.float32
x = np.ones(shape, dtype)
try:
    if case in ("shape", "dtype"):
        rt.allreduce(x, op=rt.Sum, name="grad.w")
    elif case == "op":
        rt.allreduce(x, op=rt.Max if odd else rt.Sum, name="grad.w")
    elif case == "root":
        rt.broadcast(x, root_rank=1 if odd else 0, name="grad.w")
    elif case == "kind":
        (rt.allgather if odd else rt.allreduce)(x, name="grad.w")
    else:
        raise SystemExit(f"unknown case {case}")
except rt.TensorMismatchError as e:
    caught(case, e)
else:
    say(f"NO ERROR for divergent {case}")
    sys.exit(3)
check_usable()
rt.shutdown()
