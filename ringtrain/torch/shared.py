"""ringtrain.empty_shared for torch: a CPU tensor the shm transport allreduces in place without copies (see
ringtrain/core/shared_arrays.py). Use it for a buffer you reduce every step, e.g. a flat gradient bucket."""
import math

import numpy as np
import torch

from ..core import shared_arrays


def empty_shared(*size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Like torch.empty(*size, dtype=dtype) on the CPU, in the shared window when the host transport has one."""
    shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
    # the window's bytes reinterpreted as `dtype` (bfloat16 included, which numpy lacks)
    raw = shared_arrays.empty_shared(math.prod(shape) * dtype.itemsize, np.uint8)
    return torch.from_numpy(raw).view(dtype).view(shape)
