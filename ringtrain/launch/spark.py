"""Run a function on N ringtrain ranks placed by Spark (barrier mode), Horovod-style:

    import ringtrain.spark

    def train(lr):
        import ringtrain as rt
        rt.init()                     # joins the N tasks' processes into one MPI world
        ...
        return rt.rank(), final_loss

    results = ringtrain.spark.run(train, args=(0.1,), num_proc=2)    # every rank's return value, in rank order

Spark only places the processes; MPI stays the engine. Each of the N barrier tasks starts its rank as a 1-rank MPI
job (`mpiexec -n 1`, launchers/task.py) with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT; rank 0's task picks
the port and shares it through the barrier's allGather. Barrier mode starts all N tasks together or none, and a
failing task fails them all; run() then raises RankFailedError naming the rank whose function failed.
Without an active SparkSession, run() starts a local one (`local[num_proc]`, tasks on this Python; needs a Java
runtime). Tasks that cannot all start at once (fewer free slots than num_proc) make Spark refuse the barrier stage.
"""
import os
import re
import sys

from .task import RankFailedError

__all__ = ["run", "RankFailedError"]

_FAILED = re.compile(r"ringtrain rank (\d+) failed: (.*)", re.S)


def run(fn, args=(), kwargs=None, num_proc=None):
    """fn(*args, **kwargs) on num_proc ranks (default: Spark's default parallelism); [result of rank 0, 1, ...]."""
    import cloudpickle
    from pyspark.sql import SparkSession

    spark = SparkSession.getActiveSession()
    if spark is None:
        # the tasks' Python must be this one (ringtrain and its dependencies), not the first python3 on PATH;
        # pyspark reads PYSPARK_PYTHON when the context starts
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        spark = SparkSession.builder.master(f"local[{max(1, num_proc or 1)}]").appName("ringtrain").getOrCreate()
    context = spark.sparkContext
    num_proc = int(num_proc or context.defaultParallelism)
    if num_proc < 1:
        raise ValueError(f"num_proc must be at least 1, got {num_proc}")
    payload = cloudpickle.dumps((fn, tuple(args), dict(kwargs or {})))

    def rank_task(_partition):
        from pyspark import BarrierTaskContext
        from ringtrain.launch import task
        barrier = BarrierTaskContext.get()
        rank = barrier.partitionId()
        # rank 0's host and a port free there; everyone learns them from the barrier's allGather
        mine = f"{task.host_address()} {task.free_port()}" if rank == 0 else ""
        master_addr, master_port = barrier.allGather(mine)[0].split()
        yield rank, task.run_rank(payload, rank, num_proc, master_addr, int(master_port))

    rdd = context.parallelize(range(num_proc), num_proc).barrier().mapPartitions(rank_task)
    try:
        gathered = rdd.collect()
    except Exception as error:        # Py4J / PythonException text carries our RankFailedError message
        found = _FAILED.search(str(error))
        if found:
            raise RankFailedError(int(found.group(1)), found.group(2).strip().splitlines()[0]) from None
        raise
    return [cloudpickle.loads(value) for _, value in sorted(gathered, key=lambda item: item[0])]
