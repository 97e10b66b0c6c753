"""Packaging for ringtrain.

csrc/ (the CUDA kernels' source, and the XLA FFI handler of ringtrain.jax) lives beside the package, not inside it,
so that the kernels read as a project of their own. The wheel still has to carry it: build_py copies csrc/ into
ringtrain/_csrc/, where ringtrain.csrc looks first. An editable install (`pip install -e .`) needs no copy: it falls
back to the source tree's csrc/. Nothing is compiled here: the CUDA kernels are compiled at run time (NVRTC) and
the FFI handler on first use (ringtrain/jax/ffi_build.py), so installing needs no compiler.
"""
import pathlib
import re
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = pathlib.Path(__file__).resolve().parent
KERNEL_SOURCE_SUFFIXES = (".cu", ".cuh", ".h", ".cc", ".c")


class build_py_with_kernel_sources(build_py):
    """build_py that also ships csrc/ as ringtrain/_csrc/ inside the built package."""

    def run(self):
        super().run()
        source_dir = HERE / "csrc"
        target_dir = pathlib.Path(self.build_lib) / "ringtrain" / "_csrc"
        if not source_dir.is_dir():
            return
        target_dir.mkdir(parents=True, exist_ok=True)
        for path in sorted(source_dir.iterdir()):
            if path.suffix in KERNEL_SOURCE_SUFFIXES:
                shutil.copy2(path, target_dir / path.name)

    def get_outputs(self, include_bytecode=True):
        outputs = list(super().get_outputs(include_bytecode))
        source_dir = HERE / "csrc"
        if source_dir.is_dir():
            target_dir = pathlib.Path(self.build_lib) / "ringtrain" / "_csrc"
            outputs += [str(target_dir / p.name) for p in sorted(source_dir.iterdir())
                        if p.suffix in KERNEL_SOURCE_SUFFIXES]
        return outputs


readme = HERE / "README.md"
# The version is written once, in ringtrain/__init__.py; read it as text so that building needs no dependency.
version = re.search(r'^__version__ = "([^"]+)"', (HERE / "ringtrain" / "__init__.py").read_text(encoding="utf-8"),
                    re.MULTILINE).group(1)

setup(
    name="ringtrain",
    version=version,
    description="Horovod-style data-parallel training with its own ring allreduce over MPI, shared memory, NCCL "
                "and CUDA IPC",
    long_description=readme.read_text(encoding="utf-8") if readme.exists() else "",
    long_description_content_type="text/markdown",
    author="ringtrain maintainers",
    license="Apache-2.0",
    license_files=["LICENSE"],
    keywords=["distributed training", "data parallel", "allreduce", "ring allreduce", "horovod", "mpi", "nccl",
              "pytorch", "tensorflow", "keras"],
    python_requires=">=3.9",
    packages=find_packages(include=["ringtrain", "ringtrain.*"]),
    cmdclass={"build_py": build_py_with_kernel_sources},
    install_requires=[
        "numpy",
        "ml_dtypes",
        "mpi4py>=4",
        # MPICH from pip gives a fresh machine a working `mpiexec`; cluster users swap in their own MPI (README).
        "mpich; sys_platform == 'linux' or sys_platform == 'darwin'",
    ],
    extras_require={
        "torch": ["torch>=2.1", "tqdm"],   # tqdm: the example's progress bar
        "cuda12": ["cupy-cuda12x", "nvidia-nccl-cu12"],
        "cuda13": ["cupy-cuda13x", "nvidia-nccl-cu13"],
        "test": ["pytest", "pytest-mpi", "pytest-timeout", "hypothesis", "scikit-learn"],
        "bench": ["matplotlib", "tqdm"],
        # RINGTRAIN_METRICS_PORT / RINGTRAIN_METRICS_FILE (docs/guides/observability.md)
        "metrics": ["prometheus-client>=0.17"],
        # ringtrain.tensorflow / ringtrain.keras
        "tensorflow": ["tensorflow-cpu>=2.21", "keras>=3.15"],   # GPU machines: see README
        # ringtrain.spark
        "spark": ["pyspark>=3.5", "cloudpickle"],   # barrier-mode tasks place the ranks; Java 17+ runtime needed
        # ringtrain.ray
        "ray": ["ray>=2.9", "cloudpickle"],
        # ringtrain.jax: its host-call lowering uses jax._src APIs, so the JAX minor version is pinned
        "jax": ["jax>=0.10,<0.11", "optax>=0.2"],
        # the documentation site: `mkdocs build --strict` (tests/test_docs.py runs it)
        "docs": ["mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26"],
    },
    entry_points={"console_scripts": ["ringtrain-run = ringtrain.launch.run:main"]},
    classifiers=[
        "Development Status :: 3 - Alpha",
        "Intended Audience :: Developers",
        "Intended Audience :: Science/Research",
        "License :: OSI Approved :: Apache Software License",
        "Operating System :: POSIX :: Linux",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3 :: Only",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Topic :: System :: Distributed Computing",
    ],
)
