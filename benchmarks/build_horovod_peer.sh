#!/usr/bin/env bash
# Build Horovod 0.28.1 (MPI + PyTorch, CPU) into a venv of its own, as a benchmark PEER for
# benchmarks/allreduce.py and benchmarks/train_scaling.py. Horovod is never a ringtrain dependency: keep it out of
# the development venv and out of CI, which must not see it.
#
#     benchmarks/build_horovod_peer.sh VENV
#
# VENV is created when missing and gets what the development venv has (this checkout, editable, with the
# torch,test,bench extras; torch held to a CPU build), then cmake from pip, then Horovod from its PyPI sdist.
# Why patch the sdist: 0.28.1's CMake files force C++14, and torch >= 2.1's headers need C++17.
# Environment: HOROVOD_PEER_TORCH (default torch==2.13.0+cpu, the CPU wheel CI also pins),
#              HOROVOD_PEER_JOBS (default 2: parallel compile jobs; Horovod's own default is -j8).
# The build runs under `nice -n 10`: build machines here are shared.
set -euo pipefail

if [ $# -ne 1 ]; then
    echo "usage: $0 VENV" >&2
    exit 2
fi
venv="$1"
repo="$(cd "$(dirname "$0")/.." && pwd)"
version=0.28.1
started=$SECONDS
step() { echo "== build_horovod_peer [$((SECONDS - started)) s] $*"; }

if [ ! -x "$venv/bin/python" ]; then
    step "creating $venv"
    python3 -m venv "$venv"
fi
# shellcheck disable=SC1091
source "$venv/bin/activate"      # puts the venv's mpicxx (MPICH from pip) on PATH for Horovod's MPI build

# Same guard as .ci/run: pip's plain torch wheels are CUDA builds that drag in ~3 GB of nvidia-* packages.
cpu_torch="${HOROVOD_PEER_TORCH:-torch==2.13.0+cpu}"
constraints="$venv/horovod-peer-constraints.txt"
if python -m pip install --dry-run --no-deps -q "$cpu_torch" >/dev/null 2>&1; then
    echo "$cpu_torch" > "$constraints"
    export PIP_CONSTRAINT="$constraints"
    step "constraining torch to $cpu_torch"
else
    step "WARNING: $cpu_torch is not available here; pip will choose torch itself"
fi

step "installing ringtrain's development packages from $repo"
python -m pip install -q -e "$repo[torch,test,bench]"
# --no-build-isolation below: Horovod's build needs these (and torch) in the venv itself
python -m pip install -q cmake cffi cloudpickle psutil pyyaml packaging

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
step "fetching the horovod==$version sdist"
python -m pip download -q --no-deps --no-binary :all: "horovod==$version" -d "$work"
tar -xzf "$work/horovod-$version.tar.gz" -C "$work"
src="$work/horovod-$version"

step "patching CMAKE_CXX_STANDARD 14 -> 17 (top-level and horovod/torch CMakeLists)"
for lists in "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"; do
    grep -q 'set(CMAKE_CXX_STANDARD 14)' "$lists" || { echo "no C++14 line in $lists: recipe out of date" >&2; exit 1; }
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$lists"
done

step "building (nice -n 10, -j${HOROVOD_PEER_JOBS:-2})"
(cd "$src" && MAKEFLAGS="-j${HOROVOD_PEER_JOBS:-2}" HOROVOD_CMAKE="$(command -v cmake)" \
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_GLOO=1 \
    HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
    nice -n 10 python -m pip install --no-build-isolation --no-deps .)

step "checking: 2 ranks sum distinct tensors through hvd.allreduce"
cd "$work"   # not the source tree: import the installed package
mpiexec -n 2 python -c '
import torch, horovod, horovod.torch as hvd
hvd.init()
assert hvd.mpi_built() and not hvd.gloo_built(), "expected an MPI-only build"
x = torch.arange(5, dtype=torch.float32) * (hvd.rank() + 1)
got = hvd.allreduce(x, op=hvd.Sum)
want = torch.arange(5, dtype=torch.float32) * sum(r + 1 for r in range(hvd.size()))
assert torch.equal(got, want), (got, want)
if hvd.rank() == 0:
    print("horovod", horovod.__version__, "mpi_built", hvd.mpi_built(), "size", hvd.size(), "allreduce ok")
'
step "done: $venv has horovod $version"
