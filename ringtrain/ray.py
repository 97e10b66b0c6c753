"""`ringtrain.ray.run(fn, num_workers=N)`: the Ray path users import; the launcher lives in ringtrain/launch/ray.py."""
from .launch.ray import RankFailedError, run  # noqa: F401

__all__ = ["run", "RankFailedError"]
