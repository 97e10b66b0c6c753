"""`ringtrain.spark.run(fn, num_proc=N)`: Horovod's `horovod.spark` path; the launcher lives in ringtrain/launch/spark.py."""
from .launch.spark import RankFailedError, run  # noqa: F401

__all__ = ["run", "RankFailedError"]
