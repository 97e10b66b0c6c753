"""XLA and host callbacks: ringtrain's collectives are host ops (an asynchronous op calling into Python), which XLA
cannot compile.

Keras 3 resolves model.compile(jit_compile="auto") to False on machines whose only devices are CPUs (measured
here: a tf.numpy_function inside fit then just works), but to True on a GPU machine when every layer supports XLA.
ringtrain's policy, stated once so the code and the tests agree:
- the collective stays a host callback and XLA is turned off for the train step, with a warning that says so
  (jit_compile=True -> False): correctness first, and the warning names the cost;
- the callbacks in ringtrain.keras.callbacks do this in on_train_begin, which Keras calls after building the train
  function but before it is traced, so fit then traces the step without XLA;
- without such a callback, DistributedOptimizer.apply() raises when it is traced inside an XLA cluster, naming the
  fix, rather than letting XLA fail later with an unsupported-op message.
"""
import warnings

from ringtrain.tensorflow import xla as tf_xla

XLA_WARNING = ("ringtrain.keras: model.jit_compile was {setting}; ringtrain's allreduce is a host callback that XLA "
               "cannot compile, so the train step now runs without XLA (jit_compile=False). Compile with "
               "jit_compile=False to silence this.")


def decide_jit_compile(setting):
    """(jit_compile to use, warning text or None) for the model's resolved jit_compile setting."""
    if setting:
        return False, XLA_WARNING.format(setting=setting)
    return setting, None


def turn_off_xla(model):
    """Apply decide_jit_compile to a compiled Keras model; rebuild its train function if that changed anything.
    Returns True when XLA was turned off."""
    setting = getattr(model, "jit_compile", False)
    use, warning = decide_jit_compile(setting)
    if warning is None:
        return False
    warnings.warn(warning, stacklevel=3)
    model.jit_compile = use
    model.make_train_function(force=True)
    return True


def check_not_compiling(what):
    tf_xla.check_not_compiling(
        what, "Pass ringtrain.keras.callbacks.BroadcastGlobalVariablesCallback(0) to fit (it turns XLA off with a "
              "warning) or compile with jit_compile=False (jit_compile='auto' turns XLA on on GPUs).")
