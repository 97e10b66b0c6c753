"""ringtrain-run inside a Slurm allocation: the decision as a pure function of the environment, and one real 2-rank
job in a pretend allocation whose srun is tests/launcher_scripts/fake_srun.py (hydra's slurm launcher calls it)."""
import os
import re
import subprocess
import sys

import pytest

from ringtrain.launch import run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(REPO, "tests", "launcher_scripts")
ALLOCATION = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "localhost", "SLURM_NODELIST": "localhost",
              "SLURM_TASKS_PER_NODE": "2", "SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS": "2"}


def test_outside_slurm_nothing_changes():
    assert run.slurm_plan({"PATH": "/bin"}, "hydra", 4) is None


def test_in_an_allocation_hydra_starts_its_proxies_with_srun_and_takes_the_task_count():
    env = dict(ALLOCATION, SLURM_NTASKS="8", SLURM_JOB_NUM_NODES="2", SLURM_CPUS_PER_TASK="6")
    plan = run.slurm_plan(env, "hydra")
    assert plan == run.SlurmPlan(8, ["-launcher", "slurm", "-rmk", "slurm"], 2, 6)
    cmd = run.build_command("mpiexec", "hydra", plan.num_ranks, ["python", "train.py"], wrap_ranks=False,
                            launcher_args=plan.mpiexec_args)
    assert cmd == ["mpiexec", "-n", "8", "-launcher", "slurm", "-rmk", "slurm", "python", "-m", "mpi4py", "train.py"]


def test_explicit_np_and_hostfile_win_and_openmpi_reads_the_allocation_itself():
    assert run.slurm_plan(ALLOCATION, "hydra", 3).num_ranks == 3
    assert run.slurm_plan(ALLOCATION, "hydra", 2, hostfile="hosts").mpiexec_args == []
    assert run.slurm_plan(ALLOCATION, "openmpi").mpiexec_args == []
    assert run.slurm_plan(dict(ALLOCATION, SLURM_CPUS_PER_TASK=""), "hydra").threads_per_rank is None


def test_without_a_task_count_np_is_required():
    env = {k: v for k, v in ALLOCATION.items() if k != "SLURM_NTASKS"}
    with pytest.raises(SystemExit, match="-np is required.*SLURM_NTASKS"):
        run.slurm_plan(env, "hydra")


def test_under_a_multi_task_srun_step_it_refuses_with_the_command_that_works():
    env = dict(ALLOCATION, SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS="4", SLURM_PROCID="2")
    with pytest.raises(SystemExit, match=r"task 2 of an srun step of 4 tasks.*sbatch script.*ringtrain-run python"):
        run.slurm_plan(env, "hydra")
    # a one-task step (hydra's own proxy, or `srun -n 1 ringtrain-run ...`) is fine
    assert run.slurm_plan(dict(env, SLURM_STEP_NUM_TASKS="1"), "hydra").num_ranks == 2


@pytest.mark.timeout(120)
def test_real_job_in_a_pretend_allocation_goes_through_srun(tmp_path):
    if run.mpi_flavor(run.find_mpiexec()) != "hydra":
        pytest.skip("needs MPICH's hydra mpiexec (its slurm launcher)")
    srun = tmp_path / "srun"
    srun.write_text(f"#!/bin/sh\nexec {sys.executable} {os.path.join(SCRIPTS, 'fake_srun.py')} \"$@\"\n")
    srun.chmod(0o755)
    log = tmp_path / "srun.log"
    env = dict(os.environ, **ALLOCATION, FAKE_SRUN_LOG=str(log), PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}",
               SLURM_CPUS_PER_TASK="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("OMP_NUM_THREADS", None)
    proc = subprocess.run([sys.executable, "-m", "ringtrain.launch.run", sys.executable, os.path.join(SCRIPTS, "hello.py")],
                          env=env, capture_output=True, text=True, timeout=90, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    # the ranks' lines may arrive glued together (two writers, one pipe): match them anywhere
    assert sorted(re.findall(r"hello from rank (\d+) of (\d+) OMP_NUM_THREADS=(\S+)", proc.stdout)) == \
        [("0", "2", "1"), ("1", "2", "1")], proc.stdout      # -np from SLURM_NTASKS, threads from CPUS_PER_TASK
    assert "hydra_pmi_proxy" in log.read_text()           # hydra started its proxy through srun
