"""XLA cannot run host callbacks, and every ringtrain collective inside a graph is one (tf.numpy_function).

Traced inside an XLA cluster (tf.function(jit_compile=True), or Keras's jit_compile), a collective raises
RingtrainError at trace time, naming itself and the fix, on every rank alike (they trace the same code) and before
anything is sent -- instead of TensorFlow's "Detected unsupported operations ... PyFunc" when the function first
runs. Keras's model.fit is handled one level up: ringtrain.keras's callbacks turn XLA off for the train step (see
ringtrain/keras/xla.py). Checked on CPU, where tf.function(jit_compile=True) compiles for XLA_CPU_JIT and fails
the same way as on a GPU.
"""
from tensorflow.python.framework import ops
from tensorflow.python.ops import control_flow_util

from ringtrain.errors import RingtrainError

TF_FIX = ("Call it outside the jit-compiled function (e.g. compute the gradients in a jit_compile=True function, "
          "average them with ringtrain outside it and apply them in another), or use jit_compile=False.")


class XlaHostCallbackError(RingtrainError):
    """A ringtrain collective traced inside an XLA cluster. Raised while tracing, usually from user code that
    tf.function's autograph converted: autograph re-raises such an error as its own type only when that type's
    __init__ is Exception's (anything else becomes a StagingError, which `except RingtrainError` would miss)."""
    __init__ = Exception.__init__


def in_xla_context():
    return control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph())


def check_not_compiling(what, fix=TF_FIX):
    """Raise XlaHostCallbackError (a RingtrainError) when the graph being traced is compiled by XLA."""
    if in_xla_context():
        raise XlaHostCallbackError(f"{what} is being traced inside an XLA cluster (jit_compile=True), where its host "
                             f"callback (tf.numpy_function) cannot run. {fix}")
