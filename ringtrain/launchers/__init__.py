"""Starting ranks without (or besides) mpiexec: what the environment says about the job (environment.py), joining
separately started MPI processes into one world (join.py), and running one rank inside a Spark or Ray task
(task.py, worker.py). The public entry points are ringtrain.spark.run and ringtrain.ray.run."""
