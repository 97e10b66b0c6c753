"""CUDA sources without a GPU: every csrc file compiles for sm_80 and sm_90, the loader finds the sources in an
installed wheel, and the CPU path neither detects a GPU nor imports cupy."""
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
CU_FILES = sorted((REPO / "csrc").glob("*.cu"))
NVCC = shutil.which("nvcc")


def test_csrc_has_every_kernel_file():
    assert {p.name for p in CU_FILES} >= {"reduce.cu", "batched_copy.cu", "cast.cu"}


ARCHS = ("sm_80", "sm_90")


@pytest.fixture(scope="module")
def cubins(tmp_path_factory):
    """Compile every (source, arch) pair once, all nvcc processes at the same time (reduce.cu alone takes
    ~20 s per arch on a 2-core CI machine); maps (file name, arch) -> (returncode, stderr, cubin path)."""
    if NVCC is None:
        pytest.skip("nvcc not found")
    out = tmp_path_factory.mktemp("cubins")
    running = {}
    for source in CU_FILES:
        for arch in ARCHS:
            cubin = out / f"{source.stem}.{arch}.cubin"
            running[(source.name, arch)] = (cubin, subprocess.Popen(
                [NVCC, "-cubin", f"-arch={arch}", "-I", str(REPO / "csrc"), str(source), "-o", str(cubin)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = {}
    for key, (cubin, proc) in running.items():
        _, stderr = proc.communicate(timeout=600)
        results[key] = (proc.returncode, stderr, cubin)
    return results


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", CU_FILES, ids=lambda p: p.name)
def test_kernel_source_compiles(cubins, source, arch):
    returncode, stderr, cubin = cubins[(source.name, arch)]
    assert returncode == 0, f"nvcc {arch} {source.name} failed:\n{stderr}"
    assert cubin.stat().st_size > 0


def test_every_dtype_and_op_has_a_kernel(cubins):
    """The symbol names kernels.py launches exist in the compiled code (read back with cuobjdump)."""
    cuobjdump = shutil.which("cuobjdump")
    if cuobjdump is None:
        pytest.skip("cuobjdump not found")
    names = set()
    for source in CU_FILES:
        cubin = cubins[(source.name, "sm_80")][2]
        out = subprocess.run([cuobjdump, "-elf", str(cubin)], capture_output=True, text=True, check=True).stdout
        names |= {w for w in out.replace("\n", " ").split() if w.startswith((".text.reduce_", ".text.batched_",
                                                                               ".text.cast_"))}
    dtypes = ["float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64", "int16", "uint16"]
    want = {f".text.reduce_{op}_{d}" for op in ("sum", "min", "max", "product") for d in dtypes}
    want |= {f".text.batched_scale_{d}" for d in dtypes} | {".text.batched_copy"}
    want |= {".text.cast_float32_to_float16", ".text.cast_float32_to_bfloat16", ".text.cast_float16_to_float32",
             ".text.cast_bfloat16_to_float32"}
    assert want <= names, f"missing kernels: {sorted(want - names)}"


def _run(code, **kwargs):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, **kwargs)


def test_import_ringtrain_does_not_import_cupy():
    result = _run("import sys, ringtrain, ringtrain.gpu as g; g.is_device_array(1); "
                  "print('cupy' in sys.modules)", env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_available_is_false_without_a_working_driver():
    """Here (no GPU, or an old driver) available() says False and still has not imported cupy."""
    from ringtrain import gpu
    if gpu._driver_device_count() > 0:
        pytest.skip("this machine has a CUDA device")
    result = _run("import sys, ringtrain.gpu as g; print(g.available(), g.bind(0), 'cupy' in sys.modules)",
                  env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "None", "False"]


def test_available_swallows_cuda_runtime_errors(monkeypatch):
    """The driver answers but the runtime refuses (cudaErrorInsufficientDriver, as on a too-old driver)."""
    cupy = pytest.importorskip("cupy")
    from ringtrain import gpu

    def refuse():
        raise cupy.cuda.runtime.CUDARuntimeError(35)    # 35 = cudaErrorInsufficientDriver
    monkeypatch.setattr(gpu, "_available", None)
    monkeypatch.setattr(gpu, "_driver_device_count", lambda: 1)
    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", refuse)
    assert gpu.available() is False


def test_kernel_loader_finds_sources_in_an_installed_wheel(tmp_path):
    """Build a wheel, install it into a bare directory, and import ringtrain.kernels from there (not the repo)."""
    pytest.importorskip("cupy")
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(wheels), str(REPO)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    wheel = next(wheels.glob("ringtrain-*.whl"))
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
                              str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    result = _run("import ringtrain.kernels as k; print(k.__file__); print(k.csrc_dir())", env=env, cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split()
    assert lines[-2].startswith(str(site)), f"imported {lines[-2]}, not the installed wheel"
    assert pathlib.Path(lines[-1]) == site / "ringtrain" / "_csrc"
    shipped = {p.name for p in (site / "ringtrain" / "_csrc").iterdir()}
    assert {p.name for p in CU_FILES} | {"common.cuh"} <= shipped
