"""Run a function on N ringtrain ranks placed by Ray:

    import ringtrain.ray

    results = ringtrain.ray.run(train, num_workers=2)     # every rank's return value, in rank order

Ray only places the processes; MPI stays the engine. One actor per rank (num_cpus=cpus_per_worker, one GPU each
with use_gpu=True) starts its rank as a 1-rank MPI job (`mpiexec -n 1`, launchers/task.py) with RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT; rank 0's actor names its address and a free port first. When any rank fails, every
actor is killed (their ranks die with them) and run() raises RankFailedError naming the failed rank.
Without a running Ray, run() starts a local one (ray.init()).
"""
import re

from .task import RankFailedError

__all__ = ["run", "RankFailedError"]

_FAILED = re.compile(r"ringtrain rank (\d+) failed: (.*)", re.S)


class _Rank:
    """One rank's Ray actor: it only runs launchers.task.run_rank in its own process."""

    def address(self):
        from ringtrain.launch import task
        return task.host_address(), task.free_port()

    def run(self, payload, rank, size, master_addr, master_port):
        from ringtrain.launch import task
        return task.run_rank(payload, rank, size, master_addr, master_port)


def run(fn, args=(), kwargs=None, num_workers=1, use_gpu=False, cpus_per_worker=1):
    """fn(*args, **kwargs) on num_workers ranks; [result of rank 0, 1, ...]."""
    import cloudpickle
    import ray

    if num_workers < 1:
        raise ValueError(f"num_workers must be at least 1, got {num_workers}")
    if not ray.is_initialized():
        ray.init()
    payload = cloudpickle.dumps((fn, tuple(args), dict(kwargs or {})))
    actor = ray.remote(num_cpus=cpus_per_worker, num_gpus=1 if use_gpu else 0)(_Rank)
    ranks = [actor.remote() for _ in range(num_workers)]
    try:
        master_addr, master_port = ray.get(ranks[0].address.remote())
        pending = {ref: rank for rank, ref in
                   enumerate(r.run.remote(payload, rank, num_workers, master_addr, master_port)
                             for rank, r in enumerate(ranks))}
        results = {}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            rank = pending.pop(done[0])
            try:
                results[rank] = ray.get(done[0])
            except Exception as error:   # RayTaskError wraps our RankFailedError
                found = _FAILED.search(str(error))
                if found:
                    raise RankFailedError(int(found.group(1)), found.group(2).strip().splitlines()[0]) from None
                raise RankFailedError(rank, f"its Ray actor failed: {error}") from None
        return [cloudpickle.loads(results[rank]) for rank in range(num_workers)]
    finally:
        for r in ranks:
            ray.kill(r)     # ends the actor processes, and with them any rank still running
