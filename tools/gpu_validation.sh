#!/usr/bin/env bash
# Everything that needs a GPU, in order of value, each step under its own time limit, on a machine with one GPU:
# the GPU tests (1 process, then 2 and 3 processes sharing the GPU through cuda_ipc and mpi_staged), the GPU example,
# the GPU allreduce benchmark, and then the CPU step account on the machine's own cores.
#
#     tools/gpu_validation.sh OUTDIR [SECONDS]
#
# Logs and results go to OUTDIR (summary.log is this script's own output). SECONDS (default 540) bounds the whole
# run: a step that would not fit in what is left is skipped and says so, so the summary always comes back.
# Needs: cupy and torch with CUDA, mpi4py and an mpiexec on PATH, pytest with pytest-mpi and pytest-timeout.
set -u
out=${1:?usage: tools/gpu_validation.sh OUTDIR [SECONDS]}
budget=${2:-540}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
export RINGTRAIN_STALL_WARNING_S=10 RINGTRAIN_STALL_TIMEOUT_S=60 PYTHONFAULTHANDLER=1
mpi=(mpiexec)
[ "$(id -u)" = 0 ] && mpiexec --version 2>&1 | grep -q "Open MPI" && mpi=(mpiexec --allow-run-as-root --oversubscribe)
pytest_mpi=(python -m mpi4py -m pytest --with-mpi -x -q -rs -p no:cacheprovider --timeout=120)

# step LOG LIMIT_S COMMAND...: run COMMAND with its output appended to OUTDIR/LOG, within LIMIT_S and the budget
step() {
    local log=$1 limit=$2; shift 2
    local left=$((budget - SECONDS - 5))
    if [ "$left" -lt 20 ]; then echo "== SKIPPED (budget spent): $*"; return; fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== [$SECONDS s] $* (limit ${limit} s)" | tee -a "$out/$log"
    timeout -k 5 "$limit" "$@" >>"$out/$log" 2>&1
    local rc=$?
    echo "== [$SECONDS s] rc=$rc$([ $rc = 124 ] && echo ' (time limit)')" | tee -a "$out/$log"
    grep -E "passed|failed|error|Error|SKIPPED|skipped|accuracy|wrong" "$out/$log" | tail -n 4
}

# A copied tree can carry stale git metadata: the digest of the sources names the code that ran (compare it with
# the same line run on a checkout).
digest=$(find ringtrain csrc -type f \( -name '*.py' -o -name '*.cu' -o -name '*.cuh' -o -name '*.cc' \) | LC_ALL=C sort |
         xargs cat | sha1sum | cut -c1-12)
echo "== $(date -u '+%F %T') UTC, git HEAD $(git rev-parse --short HEAD 2>/dev/null || echo '?'), sources $digest, $(nproc --all) cores"
nvidia-smi -L 2>&1 | head -2
python - <<'EOF'
import importlib, sys
versions = ["python " + sys.version.split()[0]]
for name in ("numpy", "torch", "cupy", "mpi4py"):
    try:
        versions.append(f"{name} {importlib.import_module(name).__version__}")
    except Exception as e:          # say what is missing; the steps below then fail with the cause
        versions.append(f"{name} missing ({e})")
try:
    import torch
    from mpi4py import MPI
    versions += [f"torch.cuda {torch.cuda.is_available()}", MPI.Get_library_version().splitlines()[0]]
except Exception as e:
    versions.append(f"({e})")
print(" | ".join(versions))
EOF

step tests.log 150 python -m pytest -q -rs -p no:cacheprovider --timeout=120 tests/test_gpu_kernels.py \
    tests/test_gpu_transports.py tests/test_kernels_compile.py
for n in 2 3; do
    step tests.log 120 "${mpi[@]}" -n $n "${pytest_mpi[@]}" tests/parallel/test_gpu_transports.py \
        tests/parallel/test_flag_barrier.py
done
step train.log 90 "${mpi[@]}" -n 2 python examples/gpu_train.py --epochs 2
step train.log 60 "${mpi[@]}" -n 2 python examples/gpu_train.py --epochs 1 --fp16-allreduce
for spin_us in 0 200; do         # a sync that sleeps at once against one that polls first, in the same run
    step bench.log 60 env RINGTRAIN_GPU_SPIN_US=$spin_us "${mpi[@]}" -n 2 python benchmarks/gpu_allreduce.py \
        --transports cuda_ipc,mpi_staged --sizes 4K,64K,1M,16M,64M
done
step bench.log 45 python benchmarks/gpu_allreduce.py --transports nccl,nccl_allreduce --sizes 4K,1M,16M,64M
for model in convnet resnet18 mlp; do
    step account.log 150 "${mpi[@]}" -n 2 python benchmarks/step_breakdown.py --model $model --rounds 5 \
        --steps 20 --modes no-comm,lockstep,after-backward,overlap,ddp --json "$out/step_breakdown_$model.json"
done
echo "== [$SECONDS s] done"
