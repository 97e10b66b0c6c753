"""tf.Tensor <-> array without copies where TensorFlow allows it.

Measured with tensorflow-cpu 2.21 (benchmarks/results/tf_zero_copy.txt; docs/guides/tensorflow.md quotes them):
- tf -> numpy: `tensor.numpy()` COPIES (TF returns a copy so callers cannot mutate an immutable tensor; 1.2 ms for
  16 MB here) of the view `tensor._numpy()` makes (~0.7 us at any size, every dtype, bfloat16 included as
  ml_dtypes.bfloat16); `np.from_dlpack(tensor)` is a read-only view too (~1.1 us, no bfloat16). We use the view
  (`host_view`, marked read-only): the core only reads its inputs.
- numpy -> tf: `tf.constant` / `tf.convert_to_tensor` copy. `tf.experimental.dlpack.from_dlpack` wraps the numpy
  buffer without a copy, but TF's kernels require 64-byte-aligned buffers (an unaligned one aborts the process in
  a CHECK), so results are allocated 64-byte aligned (`aligned_empty`) and only aligned arrays take the DLPack path.
- GPU tensors go to cupy through DLPack (ringtrain.gpu, imported only when a GPU tensor is seen) and come back the
  same way. Not exercised on this project's CPU-only CI.
"""

import ml_dtypes
import numpy as np
import tensorflow as tf
from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import context

from ringtrain import aligned

TF_ALIGNMENT = 64          # Eigen's EIGEN_MAX_ALIGN_BYTES on x86-64 with AVX-512
_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
# tf.experimental.dlpack.from_dlpack without its Python wrapper (~0.3 us): what that function calls
_from_dlpack = pywrap_tfe.TFE_FromDlpackCapsule


def aligned_empty(shape, dtype):
    """An uninitialised C-contiguous numpy array whose data starts on a TF_ALIGNMENT boundary."""
    return aligned.aligned_empty(shape, dtype, TF_ALIGNMENT)


_SMALL = aligned.Results(TF_ALIGNMENT)


# result_empty(shape, dtype): aligned_empty for a result handed to TF (adopt); small ones are rows of shared
# blocks (~0.3 us, not 3.5). The bound method itself: the eager call pays no frame of ours for it
result_empty = _SMALL.empty


def _address(array):
    return array.__array_interface__["data"][0]


_GPU_DEVICES = {}      # a tensor's device string -> does it name a GPU (the string test costs ~1 us per call)


def is_gpu(tensor):
    device = tensor.device
    gpu = _GPU_DEVICES.get(device)
    if gpu is None:
        if len(_GPU_DEVICES) > 256:
            _GPU_DEVICES.clear()
        gpu = _GPU_DEVICES[device] = "GPU" in (device or "").upper()
    return gpu


def to_array(tensor):
    """A numpy (CPU) or cupy (GPU) array sharing memory with an eager tf.Tensor or tf.Variable (read-only on CPU)."""
    if not isinstance(tensor, tf.Tensor):
        if not (isinstance(tensor, tf.Variable) or hasattr(tensor, "assign")):   # tf or Keras variables
            raise TypeError(f"expected a tf.Tensor or a variable, got {type(tensor).__name__}")
        tensor = tf.convert_to_tensor(tensor)
    if is_gpu(tensor):
        from ringtrain.gpu import from_dlpack  # GPU path only: keeps cupy out of CPU-only processes
        return from_dlpack(tensor)
    return host_view(tensor)


def host_view(tensor):
    """A read-only numpy view of a CPU EagerTensor's buffer (0-d: a 0-d array). EagerTensor._numpy() is the view
    .numpy() copies (~0.7 us; np.from_dlpack ~1.1, and bfloat16 has no DLPack form)."""
    array = tensor._numpy_internal()        # what _numpy() returns, without its error translation frame
    if type(array) is not np.ndarray:       # 0-d tensors give a numpy scalar
        array = np.asarray(array)
    array.setflags(write=False)             # TF tensors are immutable: nothing of ours may write through it
    return array


def adopt(array):
    """to_tensor for an array of result_empty (64-byte aligned by construction: the address is not checked, which
    costs ~1.4 us), zero-copy unless its dtype has no DLPack form."""
    if array.dtype.kind in "biuf" and array.size:
        return _from_dlpack(array.__dlpack__(), context.context()._handle)
    return tf.convert_to_tensor(array)


def to_tensor(array):
    """A tf.Tensor holding `array`'s data: zero-copy for 64-byte-aligned numpy arrays and cupy arrays, else a copy."""
    if not isinstance(array, np.ndarray):
        if hasattr(array, "__cuda_array_interface__"):
            return tf.experimental.dlpack.from_dlpack(array.toDlpack())
        array = np.asarray(array)
    if (array.size and array.flags.c_contiguous and _address(array) % TF_ALIGNMENT == 0
            and array.dtype != _BFLOAT16 and array.dtype.kind in "biuf"):
        return tf.experimental.dlpack.from_dlpack(array.__dlpack__())
    return tf.convert_to_tensor(array)
