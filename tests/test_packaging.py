"""The wheel carries what a user needs: every subpackage, csrc/ as ringtrain/_csrc, the ringtrain-run script, the
dependencies and extras. Proven on a wheel built from a copy of the source tree and imported from where it was
installed, never from the source tree."""
import configparser
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNEL_SOURCE_SUFFIXES = (".cu", ".cuh", ".h", ".cc", ".c")
BUILD_TIMEOUT_S = 300


def _has_modern_setuptools():
    """setuptools >= 70.1 builds wheels itself; older ones need the `wheel` package (then we let pip isolate)."""
    try:
        import setuptools.command.bdist_wheel  # noqa: F401
        return True
    except ImportError:
        return False


@pytest.fixture(scope="module")
def wheel_path(tmp_path_factory):
    # build from a copy: a build in the shared working tree would leave build/ behind and race other builds
    source = tmp_path_factory.mktemp("source") / "ringtrain"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "out", ".venv*"))
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(source)]
    if _has_modern_setuptools():
        cmd.insert(4, "--no-build-isolation")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    assert proc.returncode == 0, f"wheel build failed:\n{proc.stdout}\n{proc.stderr}"
    wheels = list(out.glob("ringtrain-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="module")
def installed(wheel_path, tmp_path_factory):
    """The wheel unpacked by pip into its own directory (no dependencies: those come from this environment)."""
    target = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                           str(wheel_path)], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    return target


def repo_packages():
    return sorted(os.path.relpath(root, REPO).replace(os.sep, ".")
                  for root, _dirs, files in os.walk(os.path.join(REPO, "ringtrain"))
                  if "__init__.py" in files and "__pycache__" not in root)


def repo_kernel_sources():
    csrc = os.path.join(REPO, "csrc")
    return sorted(n for n in os.listdir(csrc) if n.endswith(KERNEL_SOURCE_SUFFIXES)) if os.path.isdir(csrc) else []


def isolated_env(site_dir):
    """Import ringtrain only from site_dir: no PYTHONPATH pointing at the source tree."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site_dir)
    return env


def test_wheel_contains_every_subpackage_and_the_kernel_sources(wheel_path):
    names = set(zipfile.ZipFile(wheel_path).namelist())
    for package in repo_packages():
        assert package.replace(".", "/") + "/__init__.py" in names, f"{package} missing from {wheel_path.name}"
    assert "ringtrain/launch/run.py" in names
    kernels = repo_kernel_sources()
    shipped = sorted(n.split("/")[-1] for n in names if n.startswith("ringtrain/_csrc/"))
    assert shipped == kernels, f"csrc/ has {kernels} but the wheel's ringtrain/_csrc/ has {shipped}"


def test_wheel_declares_console_script_dependencies_and_extras(wheel_path):
    wheel = zipfile.ZipFile(wheel_path)
    dist_info = next(n.split("/")[0] for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    entry_points = configparser.ConfigParser()
    entry_points.read_string(wheel.read(f"{dist_info}/entry_points.txt").decode())
    assert entry_points["console_scripts"]["ringtrain-run"] == "ringtrain.launch.run:main"
    metadata = wheel.read(f"{dist_info}/METADATA").decode()
    requires = [line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    for needed in ("numpy", "ml_dtypes", "mpi4py", "mpich"):
        assert any(r.startswith(needed) for r in requires), f"{needed} not in {requires}"
    extras = {line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Provides-Extra:")}
    assert {"torch", "cuda12", "cuda13", "test", "bench"} <= extras
    assert 'torch>=2.1; extra == "torch"' in requires
    assert 'cupy-cuda13x; extra == "cuda13"' in requires and 'nvidia-nccl-cu12; extra == "cuda12"' in requires


def test_installed_wheel_imports_from_its_own_directory_and_finds_its_kernels(installed, tmp_path):
    code = ("import os, ringtrain; here = os.path.dirname(ringtrain.__file__); print(here); "
            "print(' '.join(sorted(os.listdir(os.path.join(here, '_csrc')))) if os.path.isdir("
            "os.path.join(here, '_csrc')) else '')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=isolated_env(installed),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == str(installed / "ringtrain"), f"imported from {lines[0]}, not from the installed wheel"
    assert (lines[1].split() if len(lines) > 1 else []) == repo_kernel_sources()


def test_installed_wheel_kernel_loader_reads_the_shipped_sources(installed, tmp_path):
    pytest.importorskip("cupy")      # kernels.py imports cupy (the GPU path); compiling needs a GPU, finding does not
    code = "import ringtrain.kernels as k; print(k.csrc_dir())"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=isolated_env(installed),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(installed / "ringtrain" / "_csrc")


def test_installed_wheel_finds_the_xla_ffi_handler_source(installed, tmp_path):
    """ringtrain.jax builds csrc/xla_host_call.cc on first use: the wheel must carry it where csrc.find looks."""
    code = "from ringtrain import csrc; print(csrc.find(['xla_host_call.cc']))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=isolated_env(installed),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(installed / "ringtrain" / "_csrc")


def test_installed_console_script_runs(installed, tmp_path):
    script = installed / "bin" / "ringtrain-run"
    assert script.exists(), sorted(p.name for p in (installed / "bin").iterdir())
    proc = subprocess.run([str(script), "--help"], cwd=tmp_path, env=isolated_env(installed),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "-np N" in proc.stdout and "--hostfile" in proc.stdout


def test_ci_has_the_compiler_the_native_host_calls_need():
    """csrc/xla_host_call.cc (ringtrain.jax's FFI lowering) and csrc/tf_host_call.cc (TensorFlow's asynchronous op)
    are built on first use where a C++ compiler is found; elsewhere the bindings fall back to Python host calls with
    a warning, and their tests test the fallback. CI must run the native code: where every extra is required
    (RINGTRAIN_REQUIRE_EXTRAS=1, set by .ci/run), a missing compiler fails here instead of passing quietly."""
    if os.environ.get("RINGTRAIN_REQUIRE_EXTRAS") != "1":
        pytest.skip("only a run that requires every extra (CI) requires the compiler")
    compiler = os.environ.get("CXX", "c++").split()[0]
    assert shutil.which(compiler), (f"no C++ compiler ({compiler!r}) on PATH: the JAX FFI lowering and the "
                                    "TensorFlow async op would never be built or tested; install g++ or set CXX")
