"""The documentation builds, and says what is true of the repository.

- `mkdocs build --strict` passes: every page is in the navigation, every link and anchor resolves, and the API
  reference renders from the docstrings.
- Every error class the package defines has its section in docs/troubleshooting.md.
- Every results file that README.md or a docs page names exists in benchmarks/results/.
- README.md and the pages read as a manual: no issue numbers, session labels or "this pass".
"""
import glob
import itertools
import os
import re
import subprocess
import sys

import pytest

from extras import need

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")
DOC_PAGES = sorted(set(glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True))
                   - set(glob.glob(os.path.join(REPO, "docs", "results", "*"))))
USER_FACING = [os.path.join(REPO, "README.md"), os.path.join(REPO, "examples", "README.md"),
               os.path.join(RESULTS, "README.md")] + DOC_PAGES


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def test_mkdocs_build_strict(tmp_path):
    need("mkdocs", "docs")
    need("mkdocstrings", "docs")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    # the API reference has an entry for every public name of the core and of the torch binding
    import inspect
    import ringtrain
    import ringtrain.jax
    import ringtrain.torch
    for module, page in ((ringtrain, "core"), (ringtrain.torch, "torch"), (ringtrain.jax, "jax")):
        html = read(tmp_path / "site" / "reference" / page / "index.html")
        ids = set(re.findall(r'id="ringtrain[\w.]*\.(\w+)"', html))
        names = getattr(module, "__all__", None) or [n for n in dir(module) if not n.startswith("_")]
        missing = [n for n in names if not inspect.ismodule(getattr(module, n)) and n not in ids]
        assert not missing, f"docs/reference/{page}.md renders no entry for {missing}"


def error_classes():
    """Every `class SomethingError(...)` defined anywhere in the package's source."""
    names = set()
    for path in glob.glob(os.path.join(REPO, "ringtrain", "**", "*.py"), recursive=True):
        names.update(re.findall(r"^class (\w+Error)\(", read(path), re.MULTILINE))
    return sorted(names)


def test_every_error_class_has_a_troubleshooting_section():
    headings = set(re.findall(r"^## (\w+)$", read(os.path.join(REPO, "docs", "troubleshooting.md")), re.MULTILINE))
    assert "TensorMismatchError" in error_classes()
    missing = [name for name in error_classes() if name not in headings]
    assert not missing, f"docs/troubleshooting.md has no '## <name>' section (cause and fix) for {missing}"


def test_every_setting_is_in_the_environment_page():
    from ringtrain.config import Config
    import dataclasses
    page = read(os.path.join(REPO, "docs", "environment.md"))
    missing = [f"RINGTRAIN_{f.name.upper()}" for f in dataclasses.fields(Config)
               if f"`RINGTRAIN_{f.name.upper()}`" not in page]
    assert not missing, f"docs/environment.md does not list {missing}"


def expand_braces(token):
    """allreduce_run{1,2}.{json,txt} -> allreduce_run1.json, allreduce_run1.txt, ..."""
    parts = re.split(r"\{([^}]*)\}", token)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def cited_results_files(text):
    """Results files a page names: `benchmarks/results/x.txt`, results/x.png, or a bare `x.json` in code quotes."""
    tokens = re.findall(r"(?:benchmarks/)?results/([\w.{},-]+\.(?:txt|json|png))", text)
    tokens += re.findall(r"`([\w{},-]+\.(?:txt|json|png))`", text)
    return {name for token in tokens for name in expand_braces(token)}


@pytest.mark.parametrize("page", USER_FACING, ids=lambda p: os.path.relpath(p, REPO))
def test_every_cited_results_file_exists(page):
    # names that pages use for files a command writes, not for committed results
    written_by_commands = {"out.json", "out.png", "trace.json", "allreduce.json", "allreduce.png",
                           "train_scaling.json", "train_scaling.png", "scaling_model.json", "scaling_model.png",
                           "train_checkpoint.pt"}
    missing = sorted(name for name in cited_results_files(read(page)) - written_by_commands
                     if not os.path.exists(os.path.join(RESULTS, name)))
    assert not missing, f"{os.path.relpath(page, REPO)} cites results files that do not exist: {missing}"


DEVELOPMENT_HISTORY = re.compile(r"\bissues? #?\d+|\bthis pass\b|\b(?:first|second|third) pass\b|\bs\d{1,2}\b|"
                                 r"\bsession\b(?!\s*=)", re.IGNORECASE)   # not TF1's `session=` argument


@pytest.mark.parametrize("page", USER_FACING, ids=lambda p: os.path.relpath(p, REPO))
def test_pages_read_as_a_manual(page):
    hits = [line.strip() for line in read(page).splitlines() if DEVELOPMENT_HISTORY.search(line)]
    assert not hits, f"{os.path.relpath(page, REPO)} reads as development history: {hits}"


def test_readme_is_short_and_its_install_command_is_what_ci_runs():
    readme = read(os.path.join(REPO, "README.md"))
    assert len(readme.splitlines()) <= 280
    ci_install = re.search(r'^pip install -e "(\.\[[^\]]*\])"$', read(os.path.join(REPO, ".ci", "run")), re.MULTILINE)
    assert ci_install, ".ci/run has no `pip install -e \".[...]\"` line"
    assert f'pip install -e "{ci_install.group(1)}"' in readme
