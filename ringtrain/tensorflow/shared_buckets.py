"""Gradient buckets that live in the shared-memory window, for callers that consume the averaged gradients at once
(ringtrain.keras's DistributedOptimizer: apply() uses them inside the same train step and nothing else sees them).

The grouped path (gradients.py) copies TensorFlow's gradients into the core's window and the averaged result out
into fresh arrays: two 7.4 MB copies per step for the keras_scaling MLP. Here each bucket owns two persistent flat
buffers from ringtrain.empty_shared, used alternately: the host call copies the gradients in (with any prescale),
the core allreduces the buffer in place -- peers read it where it lies and push their reduced blocks straight
into it, Average's 1/N fused in -- and TensorFlow gets views of it back (each tensor starts on a 64-byte boundary,
so TF adopts them without a copy). No copy-out, no per-step allocation. Measured (benchmarks/results/
tf_step_costs.txt, keras_scaling's MLP at 2 ranks): 18.8 ms per fit step against 21.8 on the copying path, host-call
CPU 2.9 against 4.2 ms (medians of 6 interleaved rounds; faster in every round).

One buffer per bucket (half the window, results valid only until the next call) was tried in tf12d: the core
alone is faster (2.9 against 3.5 ms per call, the working set halves), but fit steps were not (34.9 against 34.3 ms
in 10 interleaved rounds, faster in 4 of 10; 37.8 against 36.3 in another run's 6), so the wider margin stays
(benchmarks/results/tf_step_costs_tf12d*.txt).

The catch is lifetime: the views of call k are overwritten by call k+2 of the same bucket. Within a Keras train
step that is safe (the update that reads them finishes before the step's function returns, and the next step's
gradients depend on that update); a DistributedGradientTape hands gradients to user code, which may keep them,
so it stays on the copying path. Where the window is not available (transport other than shm, a process set
with its own window, the pool used up) the buffers are ordinary aligned memory: still correct, only with the
core's copies.
"""
import numpy as np

from ..core import shared_arrays

from .arrays import TF_ALIGNMENT, aligned_empty

BUFFERS_PER_BUCKET = 2   # used alternately; benchmarks/tf_step_costs.py sets 1 to measure one buffer against this
_buffers = {}      # (name, process set id, dtype, shapes) -> [[buffer, ...], calls so far, tensor starts]


def layout(shapes, itemsize):
    """Element offset of each tensor in a bucket (every start on a TF_ALIGNMENT-byte boundary) and the total."""
    step = max(1, TF_ALIGNMENT // itemsize)
    starts, end = [], 0
    for shape in shapes:
        end = -(-end // step) * step
        starts.append(end)
        end += int(np.prod(shape, dtype=np.int64))
    return starts, end


def _zeroed(count, dtype):
    """Shared when possible, 64-byte aligned always, zeroed: the padding between tensors is reduced too."""
    buffer = shared_arrays.empty_shared(count, dtype)
    if count and buffer.ctypes.data % TF_ALIGNMENT:
        buffer = aligned_empty((count,), dtype)
    buffer[...] = 0
    return buffer


def stage(arrays, name, prescale_factor, process_set):
    """Copy the numpy `arrays` (one dtype) into this bucket's next buffer, times prescale_factor; returns (buffer,
    views of it shaped like the arrays). The caller allreduces the buffer in place; the views stay valid until the
    call after next with the same name."""
    dtype = arrays[0].dtype
    shapes = tuple(a.shape for a in arrays)
    key = (name, process_set.process_set_id, dtype.str, shapes)
    entry = _buffers.get(key)
    if entry is None:
        starts, total = layout(shapes, dtype.itemsize)
        entry = _buffers[key] = [[_zeroed(total, dtype) for _ in range(BUFFERS_PER_BUCKET)], 0, starts]
    buffers, calls, starts = entry
    entry[1] = calls + 1
    buffer = buffers[calls % len(buffers)]
    views = []
    for array, start in zip(arrays, starts):
        view = buffer[start:start + array.size].reshape(array.shape)
        if prescale_factor != 1.0:
            np.multiply(array, prescale_factor, out=view)
        else:
            view[...] = array
        views.append(view)
    return buffer, views
