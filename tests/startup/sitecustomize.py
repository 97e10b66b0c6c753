"""Run at start-up by every Python process the test suite starts (tests/conftest.py puts this folder on PYTHONPATH):
see skip_optional_imports.py."""
import skip_optional_imports

skip_optional_imports.install()
