"""Test processes only: TensorFlow and Keras skip their optional imports of scikit-learn, matplotlib, JAX and SciPy.

`import tensorflow` imports each of these where it is installed (Keras's scikit-learn wrapper and plot helpers,
TF Lite's jax.jit, legacy Keras's scipy.sparse check), each inside `try: ... except ImportError`. The test
environment has all four for other extras, and together they cost every TensorFlow process ~3.5 s of CPU at start,
paid by ~35 processes per test run (TF ranks, Keras workers, examples). Neither ringtrain nor its tests use them
through TensorFlow, so in the processes the test suite starts an import of one of them whose importer is a
tensorflow or keras module raises ImportError, which those modules already handle. Any other importer (ringtrain,
a test, a benchmark, the package itself) imports them as usual, before or after TensorFlow.

tests/conftest.py imports this module in the pytest process and puts this folder first on PYTHONPATH, so that every
process a test starts imports it at start-up through sitecustomize.py beside it."""
import sys

OPTIONAL = ("sklearn", "matplotlib", "jax", "scipy")
IMPORTERS = ("tensorflow.", "keras.")
_MACHINERY = ("importlib", "_frozen_importlib")


class SkipOptionalImportsOfTensorFlow:
    """A meta path finder: ImportError for OPTIONAL packages when the nearest importing module is TF's or Keras's."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] not in OPTIONAL:
            return None
        frame = sys._getframe(1)
        while frame is not None:
            importer = frame.f_globals.get("__name__") or ""
            if not importer.startswith(_MACHINERY):
                if importer.startswith(IMPORTERS):
                    raise ImportError(f"{name}: an optional import of {importer} skipped in test processes "
                                      f"(tests/startup/skip_optional_imports.py)")
                return None
            frame = frame.f_back
        return None


def install():
    if not any(isinstance(finder, SkipOptionalImportsOfTensorFlow) for finder in sys.meta_path):
        sys.meta_path.insert(0, SkipOptionalImportsOfTensorFlow())

