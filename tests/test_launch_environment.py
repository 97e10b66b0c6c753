"""init() against the launcher: the decision as a pure function of the environment, and real processes started
torchrun-style -- joined into one world when each runs under its own `mpiexec -n 1`, refused when bare."""
import os
import socket
import subprocess
import sys

import pytest

from ringtrain.launch import run
from ringtrain.launch import task
from ringtrain.world.environment import LaunchError, Rendezvous, plan_world

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "tests", "launcher_scripts", "joined_allreduce.py")
WAITS_DRIVE_MPI = os.path.join(REPO, "tests", "elastic_scripts", "progress_between_mpi_calls.py")
TORCH = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500", "LOCAL_RANK": "1"}
HYDRA_ONE = {"PMI_SIZE": "1", "PMI_RANK": "0", "PMI_FD": "9"}


def test_mpi_world_or_nothing_claimed_is_left_alone():
    assert plan_world(dict(TORCH), mpi_size=2) == ("mpi", None)       # MPI already has the world
    assert plan_world({"PATH": "/bin"}, mpi_size=1) == ("mpi", None)
    assert plan_world({"WORLD_SIZE": "1", "RANK": "0"}, mpi_size=1) == ("mpi", None)
    assert plan_world(dict(HYDRA_ONE), mpi_size=1) == ("mpi", None)    # mpiexec -n 1: one rank, as asked


def test_torch_style_processes_started_by_mpiexec_n_1_join():
    assert plan_world(dict(TORCH, **HYDRA_ONE), 1) == ("join", Rendezvous(1, 2, "10.0.0.5", 29500))


@pytest.mark.parametrize("missing", ["MASTER_ADDR", "MASTER_PORT"])
def test_without_a_rendezvous_address_nothing_is_joined(missing):
    """A join needs somewhere to meet: without MASTER_ADDR or MASTER_PORT the launch is refused, not attempted."""
    environ = {k: v for k, v in dict(TORCH, **HYDRA_ONE).items() if k != missing}
    with pytest.raises(LaunchError, match="WORLD_SIZE=2"):
        plan_world(environ, 1)


@pytest.mark.parametrize("environ,names", [
    (TORCH, ["torchrun", "WORLD_SIZE=2", "rank 1", "ringtrain-run -np 2", "bare processes cannot be joined"]),
    ({"WORLD_SIZE": "4", "RANK": "3"}, ["torchrun", "WORLD_SIZE=4", "ringtrain-run -np 4"]),
    ({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "2"},
     ["srun started 4 processes", "rank 2", "ringtrain-run python train.py"]),
    ({"OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_RANK": "0"}, ["Open MPI's mpirun", "ringtrain-run -np 3"]),
    ({"PMI_SIZE": "2", "PMI_RANK": "1"}, ["PMI_SIZE=2", "different MPI library", "ringtrain-run -np 2"]),
])
def test_one_rank_worlds_of_a_bigger_launch_are_refused_naming_launcher_and_command(environ, names):
    with pytest.raises(LaunchError) as error:
        plan_world(dict(environ), mpi_size=1)
    for name in names:
        assert name in str(error.value)


def test_slurm_batch_step_alone_is_not_a_claim():
    """In an sbatch script (no srun step) SLURM_NTASKS is the allocation's, not this process's job."""
    assert plan_world({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"}, 1) == ("mpi", None)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_ranks(size, with_mpiexec, script=SCRIPT, **env_extra):
    port = _free_port()
    procs = []
    for rank in range(size):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1", **env_extra)
        cmd = [sys.executable, script]
        if with_mpiexec:
            cmd = [run.find_mpiexec(), "-n", "1"] + cmd
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
    outputs = []
    try:
        for proc in procs:
            outputs.append((proc.wait(timeout=90), proc.stdout.read()))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    return outputs


@pytest.mark.timeout(150)
def test_two_mpiexec_n_1_processes_with_world_size_2_become_one_world():
    if run.mpi_flavor(run.find_mpiexec()) != "hydra":
        pytest.skip("joining 1-rank jobs was measured with MPICH's hydra only")
    outputs = _start_ranks(2, with_mpiexec=True)
    for rank, (code, out) in enumerate(outputs):
        assert code == 0, out
        # joined processes cannot map one shared window on MPICH's default module, so the topology gives each its
        # own node, and says how to share memory
        assert f"rank {rank} of 2 via mpi: [3, 3, 3, 3, 3]" in out, out
        assert "ranks [0, 1] share this machine but cannot map one shared-memory window" in out, out
        assert "MPIR_CVAR_CH4_NETMOD=ofi" in out, out


@pytest.mark.timeout(150)
def test_a_joined_worlds_waits_drive_mpi_progress_on_ofi():
    """Joined processes talk through MPI's network module; MPICH's ofi moves data only inside MPI calls. With the
    peer checks out of reach, a root's broadcast data reaches its peers only through the waits' own MPI calls;
    without them every rank ends in a StallError after the stall timeout."""
    if run.mpi_flavor(run.find_mpiexec()) != "hydra":
        pytest.skip("joining 1-rank jobs was measured with MPICH's hydra only")
    outputs = _start_ranks(3, with_mpiexec=True, script=WAITS_DRIVE_MPI, MPIR_CVAR_CH4_NETMOD="ofi",
                           RINGTRAIN_PEER_CHECK_S="1e6", RINGTRAIN_STALL_TIMEOUT_S="20")
    for rank, (code, out) in enumerate(outputs):
        assert code == 0, out
        assert [f"rank {rank}: STEP step={step} ok=True" in out for step in range(3)] == [True] * 3, out
        assert "cannot map one shared-memory window" not in out, out     # on ofi they share memory


@pytest.mark.parametrize("user_env", [{}, {"MPIR_CVAR_CH4_NETMOD": "ucx"}])
def test_a_spark_or_ray_rank_runs_on_mpichs_ofi_module_unless_told_otherwise(monkeypatch, user_env):
    """launchers/task.py starts each rank as `mpiexec -n 1`: on ofi the joined ranks of one machine share memory."""
    started = []

    def fake_run(cmd, env, **kwargs):
        started.append(env)
        return subprocess.CompletedProcess(cmd, 1, stderr=b"")

    monkeypatch.delenv("MPIR_CVAR_CH4_NETMOD", raising=False)
    monkeypatch.setattr(task.subprocess, "run", fake_run)
    with pytest.raises(task.RankFailedError, match="rank 1 failed"):
        task.run_rank(b"", 1, 2, "127.0.0.1", 29500, env=user_env)
    [env] = started
    assert env["MPIR_CVAR_CH4_NETMOD"] == user_env.get("MPIR_CVAR_CH4_NETMOD", "ofi")
    assert (env["RANK"], env["WORLD_SIZE"]) == ("1", "2")


@pytest.mark.timeout(150)
def test_bare_processes_with_world_size_2_are_refused_on_every_rank():
    outputs = _start_ranks(2, with_mpiexec=False)
    for rank, (code, out) in enumerate(outputs):
        assert code == 3, out
        assert f"REFUSED LaunchError: torchrun" in out and f"rank {rank} as a 1-rank world" in out, out
