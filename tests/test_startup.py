"""tests/startup/: the processes the test suite starts skip TensorFlow's and Keras's optional imports of
scikit-learn, matplotlib, JAX and SciPy, and import them as usual for anyone else."""
import os
import subprocess
import sys

PROBE = """
import sys
import sitecustomize   # tests/startup's, run at this process's start-up through PYTHONPATH
for importer in ("keras.src.wrappers.fixes", "tensorflow.lite.python.util", "ringtrain.keras", "__main__"):
    try:
        exec("import matplotlib", {"__name__": importer})
        print(importer, "imported", "matplotlib" in sys.modules)
    except ImportError as error:
        print(importer, "skipped", "matplotlib" in sys.modules, error)
import matplotlib
print("then", "matplotlib" in sys.modules, sitecustomize.__file__)
"""


def test_a_started_process_skips_only_tensorflows_optional_imports():
    # the environment as tests/conftest.py left it: every process a test starts inherits PYTHONPATH
    done = subprocess.run([sys.executable, "-c", PROBE], env=dict(os.environ), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("keras.src.wrappers.fixes skipped False matplotlib: an optional import of"), lines
    assert lines[1].startswith("tensorflow.lite.python.util skipped False"), lines
    # ringtrain, a test, a script: imported as usual, and from then on by anyone
    assert lines[2:4] == ["ringtrain.keras imported True", "__main__ imported True"], lines
    assert lines[4] == f"then True {os.path.join(os.path.dirname(__file__), 'startup', 'sitecustomize.py')}", lines
