#!/usr/bin/env bash
# The CPU tables of docs/performance.md in one go, every file stamped with the git commit measured:
#   allreduce_cpu_2ranks_run{1..RUNS}.{json,txt}  float32, 4 KB..64 MB, public API (numpy and torch), raw transports,
#                                                MPI_Allreduce, gloo, Horovod (where installed), RUNS separate jobs
#   allreduce_cpu_2ranks_median.txt              median over those jobs of busbw and of each job's ratio to MPI_Allreduce
#   allreduce_cpu_4ranks.{json,txt}              one job on 4 ranks (oversubscribed on a 2-core machine)
#   train_scaling_cpu_2ranks.{json,txt,png}      1 and 2 ranks, convnet + mlp, median of ROUNDS interleaved rounds
#
#     PYTHONPATH=$PWD benchmarks/performance_tables.sh [RUNS (3)] [ROUNDS (5)]
#
# Uses `python` and `mpiexec` from PATH: activate the venv that benchmarks/build_horovod_peer.sh built to get the
# Horovod rows. OUT_DIR (default benchmarks/results of this checkout) is where the files go; SMOKE=1 runs both
# scripts at their --quick size (to check the pipeline, not to measure). Run it on a quiet machine: `uptime` is
# recorded in the text files because load moves these numbers.
set -euo pipefail

runs="${1:-3}"
rounds="${2:-5}"
cd "$(dirname "$0")/.."
out="${OUT_DIR:-benchmarks/results}"
mkdir -p "$out"
sizes=(--dtypes float32 --min-bytes 4096 --max-bytes 67108864)
quick=()
if [ "${SMOKE:-0}" = 1 ]; then sizes=(--quick); quick=(--quick); fi
impls=ringtrain-shm,ringtrain-torch-shm,ringtrain-shm-shared,ringtrain-shm-raw,ringtrain-mpi,ringtrain-mpi-raw,MPI_Allreduce,torch-gloo,horovod
stamp() { echo "# commit $(git rev-parse HEAD), $(date -u '+%Y-%m-%d %H:%M UTC'), python $(python -c 'import platform; print(platform.python_version())'), load $(uptime | sed 's/.*load average: //')"; }

for i in $(seq "$runs"); do
    { stamp; mpiexec -n 2 python benchmarks/allreduce.py "${sizes[@]}" --impls "$impls" \
        --json "$out/allreduce_cpu_2ranks_run$i.json"; } | tee "$out/allreduce_cpu_2ranks_run$i.txt"
done
{ stamp; python benchmarks/common.py headline "$out"/allreduce_cpu_2ranks_run*.json; } \
    | tee "$out/allreduce_cpu_2ranks_median.txt"

{ stamp; mpiexec -n 4 python benchmarks/allreduce.py "${sizes[@]}" \
    --impls ringtrain-shm,ringtrain-torch-shm,ringtrain-shm-shared,ringtrain-shm-raw,MPI_Allreduce \
    --json "$out/allreduce_cpu_4ranks.json"; } | tee "$out/allreduce_cpu_4ranks.txt"

{ stamp; python benchmarks/train_scaling.py "${quick[@]}" --max-ranks 2 --rounds "$rounds" \
    --json "$out/train_scaling_cpu_2ranks.json" --png "$out/train_scaling_cpu_2ranks.png"; } \
    | tee "$out/train_scaling_cpu_2ranks.txt"
