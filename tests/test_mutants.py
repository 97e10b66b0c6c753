"""tools/mutants.py's mechanics, without running any mutant: planting, STALE and INVALID detection, the commands."""
import importlib.util
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("mutants", os.path.join(REPO, "tools", "mutants.py"))
mutants = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mutants)


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text("def f(n):\n    return n + 1\n\n\ndef g(n):\n    return n + 1\n")
    return tmp_path


def mutant(old, new="return n - 1", path="pkg/mod.py"):
    return mutants.Mutant("m", path, old, new, (mutants.Tests(("tests/x.py",)),))


def test_plants_exactly_one_replacement(tree):
    assert mutants.apply(mutant("def g(n):\n    return n + 1", "def g(n):\n    return n + 2"), str(tree)) == ""
    assert (tree / "pkg" / "mod.py").read_text().endswith("def g(n):\n    return n + 2\n")


def test_missing_or_ambiguous_target_is_stale(tree):
    assert mutants.apply(mutant("return n * 1"), str(tree)).startswith("STALE: the target text occurs 0 times")
    assert mutants.apply(mutant("return n + 1"), str(tree)).startswith("STALE: the target text occurs 2 times")
    assert mutants.apply(mutant("x", path="pkg/gone.py"), str(tree)).startswith("STALE: pkg/gone.py does not exist")
    assert (tree / "pkg" / "mod.py").read_text().count("return n + 1") == 2        # untouched


def test_a_mutant_that_breaks_the_syntax_is_invalid(tree):
    assert mutants.apply(mutant("def f(n):", "def f(n)"), str(tree)).startswith("INVALID")


def test_commands_run_pytest_in_one_process_or_under_mpiexec():
    single = mutants.command(mutants.Tests(("tests/test_a.py",), select="x and y"))
    assert single[:3] == [sys.executable, "-m", "pytest"] and single[-2:] == ["-k", "x and y"]
    job = mutants.command(mutants.Tests(("tests/parallel/test_b.py",), ranks=3))
    assert job[1:3] == ["-n", "3"] and "--with-mpi" in job and "mpi4py" in job


def test_every_mutant_names_test_files_that_exist():
    names = [m.name for m in mutants.MUTANTS]
    assert len(names) == len(set(names))
    for m in mutants.MUTANTS:
        for tests in m.tests:
            for path in tests.paths:
                assert os.path.exists(os.path.join(REPO, path)), f"{m.name}: {path}"
