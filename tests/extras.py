"""Tests of an optional framework skip, with a reason, where its extra is not installed (a minimal install,
`pip install -e ".[torch,test]"`, runs the rest). With RINGTRAIN_REQUIRE_EXTRAS=1 (set by .ci/run, which installs
every extra) tests/conftest.py turns those skips into failures, so CI cannot lose a binding's tests silently.
"""
import pytest

MISSING = "extra is not installed"

# top-level modules that CI's full install brings, by the extra that brings them (setup.py); a skip for want of one
# of these is a failure under RINGTRAIN_REQUIRE_EXTRAS=1. cupy (cuda12/cuda13) is not here: CI has no GPU.
CI_MODULES = {"torch": "torch", "tqdm": "torch", "tensorflow": "tensorflow", "keras": "tensorflow",
              "jax": "jax", "jaxlib": "jax", "optax": "jax", "pyspark": "spark", "ray": "ray", "cloudpickle": "spark",
              "pytest_mpi": "test", "hypothesis": "test", "sklearn": "test", "matplotlib": "bench",
              "mkdocs": "docs", "mkdocstrings": "docs", "material": "docs",
              "prometheus_client": "metrics"}


def need(module, extra=None):
    """Import `module` or skip the calling test (or module) naming the extra that brings it."""
    extra = extra or CI_MODULES.get(module.split(".")[0], module)
    return pytest.importorskip(module, reason=f"{module} is missing: the [{extra}] {MISSING} "
                                              f"(pip install -e \".[{extra}]\")")


def required_missing(reason):
    """The skip reason names a module CI installs: under RINGTRAIN_REQUIRE_EXTRAS=1 it is a failure."""
    if MISSING in reason:
        return True
    import re
    m = re.search(r"could not import '([\w.]+)'", reason)
    return bool(m) and m.group(1).split(".")[0] in CI_MODULES
