"""tools/mutants.py's mechanics (planting, STALE and INVALID detection, the commands, the sample), every target's
freshness, and a few mutants chosen from the commit, planted and caught."""
import importlib.util
import os
import subprocess
import sys
import time

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


def test_a_jobs_processes_in_sessions_of_their_own_are_killed_after_it(tmp_path):
    """An elastic job's driver and workers start their own sessions: killing the job's group would leave them."""
    env = dict(os.environ, RINGTRAIN_MUTANT_ROOT=str(tmp_path))
    child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.Popen([sys.executable, '-c', "
                              "'import time; time.sleep(60)'], start_new_session=True).wait()"],
                             env=env, start_new_session=True)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])     # not the job's: stays
    try:
        deadline = time.monotonic() + 10
        while len(_children_of(child.pid)) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        grandchild = _children_of(child.pid)[0]
        mutants.kill_leftovers(str(tmp_path))
        assert child.wait(timeout=10) == -9
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{grandchild}") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{grandchild}")
        assert other.poll() is None
    finally:
        for p in (child, other):
            p.kill()
            p.wait()


def _children_of(pid):
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def test_every_mutant_names_test_files_that_exist():
    names = [m.name for m in mutants.MUTANTS]
    assert len(names) == len(set(names))
    for m in mutants.MUTANTS:
        for tests in m.tests:
            for path in tests.paths:
                assert os.path.exists(os.path.join(REPO, path)), f"{m.name}: {path}"


def test_every_mutant_target_occurs_exactly_once():
    """A mutant whose text has gone stale (the code moved on) would 'pass' by never being planted."""
    stale = []
    for m in mutants.MUTANTS:
        path = os.path.join(REPO, m.path)
        count = open(path, encoding="utf-8").read().count(m.old) if os.path.exists(path) else -1
        if count != 1:
            stale.append(f"{m.name}: {m.path} holds its target {count} times" if count >= 0 else
                         f"{m.name}: {m.path} does not exist")
    assert not stale, "stale mutants (plant the same bug in the code as it is now):\n" + "\n".join(stale)


def test_every_mutant_still_compiles():
    """A mutant that no longer compiles (the code around its target changed) is reported INVALID, never run."""
    broken = []
    for m in mutants.MUTANTS:
        if not m.path.endswith(".py"):
            continue
        with open(os.path.join(REPO, m.path), encoding="utf-8") as f:
            text = f.read()
        try:
            compile(text.replace(m.old, m.new), m.path, "exec")
        except SyntaxError as error:
            broken.append(f"{m.name}: {m.path} line {error.lineno}: {error.msg}")
    assert not broken, "mutants whose planted file does not compile:\n" + "\n".join(broken)


def test_the_sample_is_fixed_by_the_seed_and_keeps_to_its_budget():
    cheap = [mutants.Mutant(f"m{i}", "p", "a", "b", (mutants.Tests(("t",)),)) for i in range(20)]
    costly = [mutants.Mutant(f"j{i}", "p", "a", "b", (mutants.Tests(("t",), ranks=2),)) for i in range(5)]
    first = mutants.sample(cheap + costly, 3, "abc", budget_s=59)
    assert [m.name for m in first] == [m.name for m in mutants.sample(cheap + costly, 3, "abc", budget_s=59)]
    assert len(first) == 2 and all(not t.ranks for m in first for t in m.tests)     # 2 x 20 s fit, a 60 s job not
    assert len(mutants.sample(cheap, 3, "abc", budget_s=60)) == 3
    others = {m.name for s in ("a", "b", "c", "d") for m in mutants.sample(cheap + costly, 3, s, budget_s=60)}
    assert len(others) > 3                                                          # the seed rotates the sample
    assert len(mutants.sample(costly, 3, "abc", budget_s=10)) == 1                  # at least one, even over budget


def _commit():
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


@pytest.mark.timeout(400)
def test_a_sample_of_mutants_chosen_from_the_commit_is_caught():
    """Every commit plants a few of the table's bugs (a different few per commit) and fails on a survivor."""
    seed = os.environ.get("RINGTRAIN_MUTANT_SEED") or _commit() or "no-commit"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "mutants.py"), "--sample", "2", "--seed",
                           seed, "--budget", "60", "--no-baseline"], cwd=REPO, capture_output=True, text=True,
                          timeout=380)
    print(proc.stdout[-3000:])
    assert proc.returncode == 0 and " CAUGHT " in proc.stdout, (
        f"a planted bug was not caught (seed {seed}; rerun with RINGTRAIN_MUTANT_SEED={seed} "
        f"python tools/mutants.py --sample 2 --budget 60 --seed {seed}):\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}")


def test_every_module_has_a_planted_bug_or_a_reason():
    """A module of the package is covered by a mutant, or WITHOUT_MUTANT says why it needs none, or it is on the
    NOT_YET list, which may only shrink: a module that gains a mutant leaves it, and a new module must not join it."""
    package = os.path.join(REPO, "ringtrain")
    modules = {os.path.relpath(os.path.join(d, f), REPO) for d, _, fs in os.walk(package) for f in fs
               if f.endswith(".py")}
    covered = {m.path for m in mutants.MUTANTS}
    listed = set(mutants.WITHOUT_MUTANT) | set(mutants.NOT_YET)
    assert not set(mutants.WITHOUT_MUTANT) & set(mutants.NOT_YET)
    assert not (listed - modules), f"listed but gone: {sorted(listed - modules)}"
    assert not (covered & set(mutants.NOT_YET)), f"these have a mutant now: take them off NOT_YET: " \
                                                 f"{sorted(covered & set(mutants.NOT_YET))}"
    assert not (covered & set(mutants.WITHOUT_MUTANT)), sorted(covered & set(mutants.WITHOUT_MUTANT))
    uncovered = modules - covered - listed
    assert not uncovered, f"modules with neither a planted bug nor a reason in WITHOUT_MUTANT: {sorted(uncovered)}"
    assert len(mutants.NOT_YET) <= 25, "NOT_YET may only shrink"
