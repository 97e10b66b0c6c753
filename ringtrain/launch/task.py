"""Inside a Spark or Ray task: run one rank as a 1-rank MPI job (`mpiexec -n 1 ... launchers/worker.py`) with the
torch.distributed-style variables that make init() join it to the others, and hand back its result.

MPI stays the engine: Spark and Ray only decide where each rank's process runs. The mpiexec child is tied to the
task's process (PR_SET_PDEATHSIG), so a task the scheduler kills takes its rank down with it.
"""
import os
import pickle
import socket
import subprocess
import sys
import tempfile

from ..errors import RingtrainError
from .child import die_with_parent


class RankFailedError(RingtrainError):
    """A rank of ringtrain.spark.run / ringtrain.ray.run failed; the message names it and the error's first line
    (the rank's full traceback is in its task's stderr log)."""

    def __init__(self, rank, detail):
        super().__init__(f"ringtrain rank {rank} failed: {detail}")
        self.rank = rank


def free_port():
    """A TCP port free on this host right now (rank 0 listens on it for the others to check in)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def host_address():
    """This host's address as the other tasks can reach it."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def run_rank(payload, rank, size, master_addr, master_port, env=None):
    """Run one rank; return the cloudpickled value fn returned, or raise RankFailedError naming the rank."""
    from .run import find_mpiexec
    with tempfile.TemporaryDirectory(prefix=f"ringtrain-rank{rank}-") as tmp:
        payload_path, result_path = os.path.join(tmp, "payload"), os.path.join(tmp, "result")
        with open(payload_path, "wb") as f:
            f.write(payload)
        rank_env = dict(os.environ, **(env or {}), RANK=str(rank), WORLD_SIZE=str(size),
                        MASTER_ADDR=str(master_addr), MASTER_PORT=str(master_port), LOCAL_RANK="0")
        # The ranks are separately started MPI jobs joined at init(), so every message between them goes through
        # MPICH's network module. On ofi, ranks on one machine share memory (the shm transport) and a joined world
        # trains at a plain mpiexec job's speed; on ucx each is its own node (the mpi transport, 1.5x slower steps
        # measured at 3-4 ranks), and ucx crashed a process sending to a peer that had just died.
        rank_env.setdefault("MPIR_CVAR_CH4_NETMOD", "ofi")
        cmd = [find_mpiexec(), "-n", "1", sys.executable, "-m", "ringtrain.launch.task_worker", payload_path,
               result_path]
        proc = subprocess.run(cmd, env=rank_env, stdin=subprocess.DEVNULL, stdout=None, stderr=subprocess.PIPE,
                              preexec_fn=die_with_parent)
        if os.path.exists(result_path):
            with open(result_path, "rb") as f:
                kind, value = pickle.load(f)
            if kind == "ok":
                return value
            raise RankFailedError(rank, value.strip())
        tail = proc.stderr.decode(errors="replace")[-3000:].strip()
        raise RankFailedError(rank, f"its process exited with status {proc.returncode} without a result"
                                    + (f":\n{tail}" if tail else ""))
