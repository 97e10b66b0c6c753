"""A small data-parallel training function (linear regression, SGD on averaged gradients) that returns what a rank
ends with; run by tests under mpiexec (as a script: prints JSON per rank), ringtrain.spark.run and ringtrain.ray.run.
Each rank trains on its own shard, so the result depends on the world being one world."""
import json


def train(steps=20, lr=0.1, fail_rank=None, pid_dir=None):
    import os

    import numpy as np
    import ringtrain as rt

    rt.init()
    rank, size = rt.rank(), rt.size()
    if pid_dir:       # lets a test check that no rank outlives a failed job
        with open(os.path.join(pid_dir, f"rank{rank}.pid"), "w") as f:
            f.write(str(os.getpid()))
    rt.barrier()
    if rank == fail_rank:
        raise RuntimeError(f"planted failure on rank {rank}")
    rng = np.random.default_rng(0)
    true_w = rng.normal(size=4)
    x = rng.normal(size=(64, 4))
    y = x @ true_w
    shard = slice(rank * len(x) // size, (rank + 1) * len(x) // size)
    w = np.zeros(4)
    for step in range(steps):
        grad = 2 * x[shard].T @ (x[shard] @ w - y[shard]) / (shard.stop - shard.start)
        w -= lr * rt.allreduce(grad, op=rt.Average, name=f"grad.{step}")
    return {"rank": rank, "size": size, "w": w.tolist()}


if __name__ == "__main__":
    print("RESULT " + json.dumps(train()), flush=True)
