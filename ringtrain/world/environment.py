"""What the environment says about the job, checked against what MPI sees, so a script never silently trains N
independent copies of itself.

    torchrun --nproc_per_node=2 train.py    # two processes, each a 1-rank MPI world: without this, two copies
    srun -n 4 python train.py               # pip's MPICH does not speak Slurm's PMI: four 1-rank worlds

`plan_world(environ, mpi_size)` is the pure decision, made at init():
- MPI sees more than one rank, or nothing says there should be more: use MPI's world ("mpi");
- RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT are set and this process was started by an MPI launcher as a 1-rank
  job (`mpiexec -n 1`, hydra's PMI_SIZE=1): join the WORLD_SIZE processes into one world ("join", launchers/join.py;
  this is how ringtrain.spark and ringtrain.ray start ranks);
- otherwise raise LaunchError naming the launcher and the command that works, on every process.
"""
import collections

from ..errors import RingtrainError


class LaunchError(RingtrainError):
    """The processes were started in a way that would not give one ringtrain world."""


Rendezvous = collections.namedtuple("Rendezvous", "rank size master_addr master_port")

# (size variable, rank variable, who sets them, applies only when this other variable is set)
CLAIMS = (
    ("WORLD_SIZE", "RANK", "torchrun (or another torch.distributed-style launcher)", None),
    ("SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "srun", "SLURM_STEP_ID"),
    ("SLURM_NTASKS", "SLURM_PROCID", "srun", "SLURM_STEP_ID"),
    ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "Open MPI's mpirun", None),
    ("PMIX_SIZE", "PMIX_RANK", "a PMIx launcher", None),
    ("PMI_SIZE", "PMI_RANK", "an MPI launcher (PMI)", None),
    ("MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK", "MVAPICH's mpirun_rsh", None),
)


def _int(environ, name):
    value = str(environ.get(name, "")).strip()
    return int(value) if value.isdigit() else None


def claimed_world(environ):
    """(launcher, size, rank) of the first launcher variable that says there is more than one process, else None."""
    for size_var, rank_var, launcher, only_with in CLAIMS:
        if only_with is not None and environ.get(only_with) is None:
            continue
        size = _int(environ, size_var)
        if size is not None and size > 1:
            return launcher, size, _int(environ, rank_var), size_var
    return None


def started_as_one_rank_mpi_job(environ):
    """True for a process hydra (`mpiexec -n 1`) started: it can join others; a bare singleton cannot."""
    return _int(environ, "PMI_SIZE") == 1 and ("PMI_FD" in environ or "PMI_PORT" in environ)


def plan_world(environ, mpi_size):
    """("mpi", None) | ("join", Rendezvous) | raises LaunchError. Pure: reads only `environ` and `mpi_size`."""
    if mpi_size > 1:
        return "mpi", None
    claim = claimed_world(environ)
    if claim is None:
        return "mpi", None
    launcher, size, rank, size_var = claim
    torch_style = all(environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
    if torch_style and size_var == "WORLD_SIZE" and started_as_one_rank_mpi_job(environ):
        return "join", Rendezvous(rank, size, environ["MASTER_ADDR"], int(environ["MASTER_PORT"]))
    raise LaunchError(_explain(launcher, size, rank, size_var, torch_style))


def _explain(launcher, size, rank, size_var, torch_style):
    who = f"rank {rank}" if rank is not None else "this process"
    head = (f"{launcher} started {size} processes ({size_var}={size}), but MPI sees {who} as a 1-rank world of "
            f"its own: training would run {size} independent copies. ")
    works = (f"Start the job with `ringtrain-run -np {size} python train.py` (or `mpiexec -n {size} python "
             f"train.py`, with the mpiexec beside this Python)")
    if size_var == "WORLD_SIZE":
        join = ("; processes that each run under their own `mpiexec -n 1` with RANK, WORLD_SIZE, MASTER_ADDR and "
                "MASTER_PORT set are joined into one world automatically (bare processes cannot be joined)"
                if torch_style else "")
        return head + "ringtrain's ranks are MPI processes. " + works + join + "."
    if launcher == "srun":
        return (head + "This Python's MPI (pip's MPICH) does not take its world from srun's PMI. Inside the "
                "allocation (sbatch script or salloc shell) run `ringtrain-run python train.py` once: it starts "
                "the ranks through srun itself. Or use an mpi4py built against the cluster's Slurm-aware MPI.")
    return (head + f"mpi4py here uses a different MPI library than the launcher ({launcher}). " + works + ".")
