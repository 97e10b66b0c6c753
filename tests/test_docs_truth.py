"""The documentation cannot contradict the code: every check here reads README.md and the docs pages and compares what
they say with the package, the launcher, setup.py and benchmarks/results/.

- every `hvd.X`, `rt.X` and `ringtrain.X` a page uses (code blocks and inline code) exists in the module the page
  imports at that point (or is about);
- every row of the porting tables: "supported" names exist, "not supported" names do not;
- a sentence that says a module keeps some of Horovod's names is true of every module it names;
- every measured figure (a number with a unit, or a decimal in a table) is in a results file its paragraph or
  section cites, and every program output a page shows is in a cited results file;
- every file in benchmarks/results/ is listed in its README;
- every `ringtrain-run` flag a page uses is in `ringtrain-run --help`, and what pages say makes a job elastic is
  what the launcher does;
- version claims agree with setup.py;
- statements the code decides (gradients as bucket views, shared memory between separately started processes,
  what has run on a GPU, the kernels' fraction of a copy) and no lab log in pages a user reads.

The checks live in tests/docs_checks.py; the fixture tests at the end show that each one fails on a page that makes
the mistake it guards against.
"""
import glob
import os
import re
import subprocess
import sys

import pytest

import docs_checks as dc
from extras import need

REPO = dc.REPO
RESULTS = dc.RESULTS
DOC_PAGES = sorted(p for p in glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True)
                   if os.sep + "results" + os.sep not in p)
USER_PAGES = [p for p in [os.path.join(REPO, "README.md"), os.path.join(REPO, "examples", "README.md"),
                           os.path.join(RESULTS, "README.md")] + DOC_PAGES
              if os.path.exists(p)]       # (tools/mutants.py's copies leave benchmarks/results/ out)
rel = lambda p: os.path.relpath(p, REPO)   # noqa: E731


def page_ids(pages):
    return [rel(p) for p in pages]


def resolve_or_skip(name, missing_extras):
    try:
        return dc.resolve(name)
    except dc.ExtraMissing as e:
        missing_extras.add(str(e))
        return True


def skip_for_extras(missing_extras, checked):
    if missing_extras:
        for module in sorted(missing_extras):
            need(module)          # skips (or, with RINGTRAIN_REQUIRE_EXTRAS=1, fails) naming the extra


# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("page", USER_PAGES, ids=page_ids(USER_PAGES))
def test_every_name_a_page_uses_exists(page):
    missing_extras, wrong = set(), []
    text = dc.read(page)
    for name, line in dc.used_names(text, dc.page_module(rel(page))):
        if not resolve_or_skip(name, missing_extras):
            wrong.append(f"line {line}: {name}")
    assert not wrong, f"{rel(page)} uses names that do not exist: {wrong}"
    skip_for_extras(missing_extras, wrong)


@pytest.mark.parametrize("page", [os.path.join(REPO, "README.md"), os.path.join(REPO, "docs", "porting", "horovod.md")],
                         ids=["README.md", "docs/porting/horovod.md"])
def test_porting_tables_agree_with_the_modules(page):
    missing_extras = set()
    text = dc.read(page)
    try:
        wrong = dc.porting_contradictions(text) + dc.module_sentence_contradictions(text)
    except dc.ExtraMissing as e:
        need(str(e))
        raise
    assert dc.porting_rows(text), f"{rel(page)} has no porting table"
    assert not wrong, f"{rel(page)}: {wrong}"
    skip_for_extras(missing_extras, wrong)


@pytest.mark.parametrize("page", USER_PAGES, ids=page_ids(USER_PAGES))
def test_every_figure_is_in_a_results_file_it_cites(page):
    wrong = dc.uncited_figures(dc.read(page))
    assert not wrong, (f"{rel(page)}: figures not found in the results files cited in their paragraph or section "
                       f"(line, figure, files): {wrong}")


@pytest.mark.parametrize("page", USER_PAGES, ids=page_ids(USER_PAGES))
def test_every_output_a_page_shows_is_recorded(page):
    wrong = dc.unrecorded_output(dc.read(page))
    assert not wrong, f"{rel(page)}: output lines that no results file cited in the section holds: {wrong}"


def test_every_results_file_is_listed_in_the_results_index():
    index = dc.read(os.path.join(RESULTS, "README.md"))
    patterns = dc.listed_in_index(index)
    files = sorted(f for f in os.listdir(RESULTS) if f != "README.md")
    missing = [f for f in files if not any(p.match(f) for p in patterns)]
    assert not missing, f"benchmarks/results/README.md does not list {missing}"
    gone = sorted(n for n in dc.cited_results_files(index) if not os.path.exists(os.path.join(RESULTS, n)))
    assert not gone, f"benchmarks/results/README.md lists files that do not exist: {gone}"


@pytest.fixture(scope="module")
def launcher_help():
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-m", "ringtrain.launch.run", "--help"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_every_launcher_flag_in_the_docs_exists(launcher_help):
    known = dc.launcher_help_flags(launcher_help)
    wrong = {rel(p): sorted(dc.launcher_flags_used(dc.read(p)) - known) for p in USER_PAGES}
    wrong = {p: flags for p, flags in wrong.items() if flags}
    assert not wrong, f"ringtrain-run flags that `ringtrain-run --help` does not have: {wrong}"


def elastic_flags_of_the_launcher(launcher_help):
    """The flags that make ringtrain-run's job elastic, found by parsing a command line with each flag alone."""
    import importlib
    import inspect
    try:                                     # where ringtrain-run's command line is parsed
        run = importlib.import_module("ringtrain.launch.options")
    except ModuleNotFoundError:
        run = importlib.import_module("ringtrain.launch.run")
    parse = run.parse_args
    if "prog" in inspect.signature(parse).parameters:
        parse = lambda argv, _parse=run.parse_args: _parse(argv, prog="ringtrain-run")   # noqa: E731
    flags = {f for f in dc.launcher_help_flags(launcher_help) if f.startswith("-") and f not in ("-h", "--help")}
    values = {"--blacklist-cooldown-range": ["1", "2"]}
    elastic = set()
    original = run._check_elastic_args
    run._check_elastic_args = lambda parser, args: None
    try:
        for flag in sorted(flags):
            if flag in ("-np", "-n", "--hostfile", "-f", "--no-rank-wrapper", "--no-abort-on-exception"):
                argv = ["-np", "2"] + ([flag] if flag.startswith("--no-") else [])
            else:
                argv = ["-np", "2", flag] + values.get(flag, ["3"])
            try:
                args = parse(argv + ["python", "x.py"])
            except SystemExit:
                continue
            if args.elastic:
                elastic.add(flag)
    finally:
        run._check_elastic_args = original
    return elastic


def test_what_the_docs_say_makes_a_job_elastic_is_what_the_launcher_does(launcher_help):
    actual = elastic_flags_of_the_launcher(launcher_help)
    assert actual == {"--min-np", "--max-np", "--host-discovery-script"}
    claims = [(rel(p), s, flags) for p in USER_PAGES for s, flags in dc.elastic_flag_claims(dc.read(p))]
    assert claims, "no page says which flags make a job elastic"
    wrong = [(p, s) for p, s, flags in claims if flags != actual]
    assert not wrong, f"these say other flags make a job elastic than {sorted(actual)}: {wrong}"


@pytest.mark.parametrize("page", USER_PAGES, ids=page_ids(USER_PAGES))
def test_version_claims_come_from_setup_py(page):
    mins = dc.setup_minimums(dc.read(os.path.join(REPO, "setup.py")))
    wrong = dc.version_contradictions(dc.read(page), mins)
    assert not wrong, f"{rel(page)}: {wrong}"


def gpu_ran():
    """What the GPU results files show ran on a GPU."""
    ran = []
    text = "".join(dc.read(p) for p in glob.glob(os.path.join(RESULTS, "gpu_validation_*.txt")))
    for name in ("gpu_train.py", "test_gpu_kernels.py", "test_gpu_transports.py"):
        if name in text:
            ran.append(name)
    return ran


@pytest.mark.parametrize("page", USER_PAGES, ids=page_ids(USER_PAGES))
def test_statements_the_code_and_results_decide(page):
    text = dc.read(page)
    assert not dc.gradient_view_overclaims(text), \
        f"{rel(page)} says .grads are always bucket views (large gradients reduced after backward are refilled)"
    assert not dc.memory_window_overclaims(text), \
        f"{rel(page)} says separately started processes cannot share memory, without naming ucx (on ofi they do)"
    assert not dc.stale_gpu_claims(text, gpu_ran()), \
        f"{rel(page)} says something has not run on a GPU that benchmarks/results/gpu_validation_*.txt shows ran"
    measured = dc.measured_copy_fractions(dc.read(os.path.join(RESULTS, "gpu_validation_h200.txt")))
    wrong = dc.copy_fraction_contradictions(text, measured)
    assert not wrong, f"{rel(page)}: {wrong} (gpu_validation_h200.txt)"
    wrong = dc.gpu_pointers_to_pages_without_gpu_results(text, page)
    assert not wrong, f"{rel(page)} sends readers elsewhere for the GPU numbers: {wrong}"
    fitted = dc.model_without_its_fit_error(text)
    assert not fitted, f"{rel(page)} cites the fitted model {fitted} without saying how large its fit error is"


@pytest.mark.parametrize("page", USER_PAGES + [os.path.join(REPO, "CHANGELOG.md")],
                         ids=page_ids(USER_PAGES + [os.path.join(REPO, "CHANGELOG.md")]))
def test_pages_are_not_a_lab_log(page):
    text = dc.read(page)
    hits = dc.lab_log_lines(text)
    if page == os.path.join(RESULTS, "README.md"):       # the index of results files may name the A/B runs
        hits = [line for line in hits if "heavy-run lock" in line]
    assert not hits, f"{rel(page)} reads as a lab log: {hits[:5]}"


def test_quick_claims_hold():
    """A page saying the benchmarks it lists have `--quick` is true of each script it lists."""
    wrong = []
    for page in USER_PAGES:
        items = dc.blocks(dc.read(page))
        for i, (kind, body, _) in enumerate(items):
            if kind == "prose" and re.search(r"(?:Each|every one|All) (?:has|have|takes?) `--quick`", body):
                scripts = re.findall(r"([\w/]+\.py)", items[i - 1][1]) if i and items[i - 1][0] == "code" else []
                wrong += [f"{rel(page)}: {s}" for s in scripts
                          if "--quick" not in dc.read(os.path.join(REPO, s))]
    assert not wrong, f"these have no --quick: {wrong}"


@pytest.mark.parametrize("module", ["ringtrain.jax", "ringtrain.elastic", "ringtrain.spark", "ringtrain.ray"])
def test_every_public_module_has_an_api_reference_page(module):
    pages = {rel(p): dc.read(p) for p in glob.glob(os.path.join(REPO, "docs", "reference", "*.md"))}
    assert any(re.search(rf"^::: {re.escape(module)}$", t, re.MULTILINE) for t in pages.values()), \
        f"no docs/reference page renders `::: {module}`"
    nav = dc.read(os.path.join(REPO, "mkdocs.yml"))
    assert module in nav


def test_jax_has_a_guide():
    guide = os.path.join(REPO, "docs", "guides", "jax.md")
    assert os.path.exists(guide)
    assert "guides/jax.md" in dc.read(os.path.join(REPO, "mkdocs.yml"))
    assert "import ringtrain.jax" in dc.read(guide)


def test_readme_installs_minimal_first_then_everything_then_gpus():
    readme = dc.read(os.path.join(REPO, "README.md"))
    installs = re.findall(r'pip install -e "\.\[([^\]]*)\]"', readme)
    assert installs[:3] and installs[0] == "torch,test", installs
    full = next(i for i, extras in enumerate(installs) if "tensorflow" in extras)
    gpu = next(i for i, extras in enumerate(installs) if "cuda" in extras)
    assert 0 < full < gpu, installs
    first = readme.index('pip install -e ".[torch,test]"')
    assert re.search(r"\d+(?:\.\d+)? GB", readme[first - 400:first + 400]), "the minimal install's size is not stated"
    assert re.search(r"about \d+ min", readme), "the test command's duration is not stated"
    ci = dc.read(os.path.join(REPO, ".ci", "run"))
    assert "RINGTRAIN_REQUIRE_EXTRAS=1" in ci


# ---------------------------------------------------------------------------------------------------------------
# each check fails on a page that makes its mistake (the contradictions these tests were written for)


def test_fixture_names_are_checked_in_the_module_the_page_imports():
    page = "```python\nimport ringtrain.keras as hvd\nhvd.init()\n```\nThen `hvd.start_timeline(...)`.\n"
    names = [n for n, _ in dc.used_names(page)]
    assert names == ["ringtrain.keras", "ringtrain.keras.init", "ringtrain.keras.start_timeline"]
    page = "`import horovod.torch as hvd` becomes `import ringtrain.torch as hvd`; `hvd.is_homogeneous()`"
    assert [n for n, _ in dc.used_names(page)][-1] == "ringtrain.torch.is_homogeneous"
    assert dc.used_names("```python\nimport horovod.torch as hvd\nhvd.init()\n```") == []
    assert not dc.resolve("ringtrain.torch.no_such_name")
    assert dc.resolve("ringtrain.torch.Compression.fp16")


def test_fixture_a_not_supported_row_naming_something_that_exists_fails():
    pytest.importorskip("tensorflow", reason="tensorflow is missing: the [tensorflow] extra is not installed")
    table = ("| horovod.tensorflow (.keras) | ringtrain.tensorflow (.keras) | how it differs |\n| --- | --- | --- |\n"
             "| `LocalGradientAggregationHelperEager`, `keras.elastic` | not supported | |\n")
    assert dc.porting_contradictions(table) == [
        "`keras.elastic` is marked 'not supported' but ringtrain.keras.elastic exists"]
    table = ("| horovod.torch | ringtrain.torch | how it differs |\n| --- | --- | --- |\n"
             "| `init(comm=None)`, `no_such_thing` | supported | |\n")
    assert dc.porting_contradictions(table) == [
        "`no_such_thing` is marked 'supported' but none of ['ringtrain.torch.no_such_thing'] exists"]


def test_fixture_a_sentence_claiming_tensorflow_has_a_missing_name_fails():
    pytest.importorskip("tensorflow", reason="tensorflow is missing: the [tensorflow] extra is not installed")
    wrong = ("`ringtrain.tensorflow` and `ringtrain.keras` keep Horovod's names (`DistributedGradientTape`, "
             "`LocalGradientAggregationHelperEager`, `broadcast_variables`).")
    assert any("ringtrain.tensorflow keeps `LocalGradientAggregationHelperEager`" in m
               for m in dc.module_sentence_contradictions(wrong))
    right = "`ringtrain.keras` keeps Horovod's names (`DistributedOptimizer`, `broadcast_variables`)."
    assert dc.module_sentence_contradictions(right) == []


def test_fixture_the_h_flag_does_not_make_a_job_elastic(launcher_help):
    page = "- `--min-np`, `--max-np`, `--host-discovery-script` and `-H` make the job elastic: see elastic.md.\n"
    (sentence, flags), = dc.elastic_flag_claims(page)
    assert flags != elastic_flags_of_the_launcher(launcher_help)
    assert dc.launcher_flags_used("```bash\nringtrain-run -np 2 --no-such-flag python x.py\n```") == \
        {"-np", "--no-such-flag"}


def test_fixture_separately_started_processes_sharing_memory():
    wrong = ("Every world of an elastic job is made of separately started MPI processes, which MPICH does not let "
             "share a memory window, so collectives travel over the MPI transport.")
    assert dc.memory_window_overclaims(wrong)
    right = ("On MPICH's ucx module separately started processes cannot share a memory window; on ofi (the "
             "default for elastic workers) they do.")
    assert not dc.memory_window_overclaims(right)


def test_fixture_grads_always_bucket_views():
    assert dc.gradient_view_overclaims("After the first step `.grad`s are always views of the buckets.")
    assert not dc.gradient_view_overclaims("After step 1 `.grad`s are views of the buckets, except large gradients "
                                           "reduced after backward, which `zero_grad()` sets to None.")


def test_fixture_stale_gpu_story():
    assert dc.stale_gpu_claims("`gpu_train.py` has not run on a GPU yet.", ["gpu_train.py"])
    assert dc.stale_gpu_claims("The new code is not yet measured on a GPU.", [])
    measured = dc.measured_copy_fractions(dc.read(os.path.join(RESULTS, "gpu_validation_h200.txt")))
    assert min(measured) < 92 <= 96 <= max(measured) + 1          # int8 Average's 62% is in the file
    assert dc.copy_fraction_contradictions("The reductions ran at 92-96% of a device-to-device copy's bandwidth.",
                                           measured)
    assert not dc.copy_fraction_contradictions("The reductions ran at 92-96% of a copy's bandwidth, except int8 "
                                               "Average at 62%.", measured)


def test_fixture_version_claims():
    mins = dc.setup_minimums('python_requires=">=3.9",\n"tensorflow-cpu>=2.21", "keras>=3.15", "torch>=2.1"')
    assert mins == {"python": "3.9", "tensorflow-cpu": "2.21", "keras": "3.15", "torch": "2.1"}
    assert dc.version_contradictions("work with TensorFlow >= 2.16 and Keras 3", mins)
    assert dc.version_contradictions("needs Python 3.8 or newer", mins)
    assert not dc.version_contradictions("TensorFlow >= 2.21, Python 3.9 or newer", mins)


def test_fixture_figures_must_be_in_the_cited_file():
    cited = ("A killed worker costs 0.21 s at 4 workers (`benchmarks/results/elastic_recovery_ofi_progress.txt`).\n")
    assert dc.uncited_figures(cited) == []
    wrong = "A killed worker costs 0.37 s at 4 workers (`benchmarks/results/elastic_recovery_ofi_progress.txt`).\n"
    assert [f for _, f, _ in dc.uncited_figures(wrong)] == ["0.37"]
    assert [f for _, f, _ in dc.uncited_figures("It is 1.32x faster.\n")] == ["1.32"]
    table = "(`allreduce_cpu_2ranks_median.txt`)\n\n| impl | 1 MB |\n| --- | ---: |\n| numpy | 6.80 (1.72x) |\n"
    assert dc.uncited_figures(table) == []
    assert [f for _, f, _ in dc.uncited_figures(table.replace("6.80", "6.90"))] == ["6.90"]


def test_fixture_shown_output_must_be_recorded():
    page = ("## Run\n\nFrom `benchmarks/results/examples_train_accuracy.txt`:\n\n```\n"
            "final: ranks 2  epochs 20  test accuracy 0.9415  train time 0.67 s\n```\n")
    assert dc.unrecorded_output(page) == []
    assert dc.unrecorded_output(page.replace("0.67", "0.76"))


def test_fixture_lab_log():
    assert dc.lab_log_lines("Commit ca5581c, 08:39-08:40 UTC, under the heavy-run lock.")
    assert dc.lab_log_lines("## Changed during development")
    assert not dc.lab_log_lines("float32 allreduce, 2 ranks, 2026-11-25.")


def test_fixture_keeps_names_with_a_colon():
    pytest.importorskip("tensorflow", reason="tensorflow is missing: the [tensorflow] extra is not installed")
    wrong = ("`ringtrain.tensorflow` and `ringtrain.keras` keep Horovod's names: `DistributedGradientTape`, "
             "`LocalGradientAggregationHelperEager`, `broadcast_variables`.")
    assert any("ringtrain.tensorflow keeps `LocalGradientAggregationHelperEager`" in m
               for m in dc.module_sentence_contradictions(wrong))


def test_index_links_every_guide():
    index = dc.read(os.path.join(REPO, "docs", "index.md"))
    guides = sorted(os.path.basename(p) for p in glob.glob(os.path.join(REPO, "docs", "guides", "*.md")))
    missing = [g for g in guides if f"guides/{g}" not in index]
    assert not missing, f"docs/index.md does not link {missing}"


@pytest.mark.parametrize("page", USER_PAGES, ids=page_ids(USER_PAGES))
def test_python_examples_import_what_they_use(page):
    """A Python block that uses os., np., torch. (...) imports it (or is a fragment that imports nothing)."""
    wrong = []
    for kind, body, line in dc.blocks(dc.read(page)):
        if kind != "code" or dc.LANGUAGES.get(dc.read(page), {}).get(line) != "python" or "import " not in body:
            continue
        for module, alias in (("os", "os"), ("numpy", "np"), ("torch", "torch"), ("jax", "jax"), ("optax", "optax"),
                              ("tensorflow", "tf"), ("keras", "keras")):
            if re.search(rf"(?<![\w.]){alias}\.", body) and not re.search(rf"^\s*(?:import|from) .*\b{module}\b|\bas {alias}\b", body, re.MULTILINE):
                wrong.append(f"line {line}: uses {alias}. without importing {module}")
    assert not wrong, f"{rel(page)}: {wrong}"


EXTRA_TEST = '''
import pytest
from extras import need

def test_needs_an_absent_extra():
    need("ringtrain_no_such_module", "jax")

def test_plain():
    pass
'''


@pytest.mark.parametrize("require, outcome", [("", "1 passed, 1 skipped"), ("1", "1 failed, 1 passed")])
def test_an_absent_extra_skips_and_fails_under_require_extras(tmp_path, require, outcome):
    (tmp_path / "test_extra.py").write_text(EXTRA_TEST)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(REPO, "tests"), REPO]),
               RINGTRAIN_REQUIRE_EXTRAS=require)
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-q", "-p", "no:cacheprovider",
                           str(tmp_path / "test_extra.py")], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert outcome in done.stdout, done.stdout + done.stderr
    if require:
        assert "RINGTRAIN_REQUIRE_EXTRAS=1" in done.stdout and "[jax] extra is not installed" in done.stdout


def test_fixture_a_pointer_for_the_gpu_numbers_must_lead_to_them(tmp_path):
    (tmp_path / "performance.md").write_text("CPU figures only, from `allreduce_cpu_full_sweep.json`.\n")
    (tmp_path / "gpus.md").write_text("From `benchmarks/results/gpu_validation_h200.txt`: it ran.\n")
    readme = tmp_path / "README.md"
    stale = "How these were measured, and the GPU numbers: [docs](performance.md).\n"
    assert dc.gpu_pointers_to_pages_without_gpu_results(stale, str(readme))
    assert not dc.gpu_pointers_to_pages_without_gpu_results("The GPU measurements: [GPUs](gpus.md).\n", str(readme))


def test_fixture_a_fitted_model_without_its_fit_error():
    page = "The model (`benchmarks/results/scaling_model.txt`) projects 95% at 1,024 GPUs.\n"
    assert dc.model_without_its_fit_error(page) == ["scaling_model.txt"]
    assert not dc.model_without_its_fit_error(page + "Its largest fit error is 17% to 78%.\n")
