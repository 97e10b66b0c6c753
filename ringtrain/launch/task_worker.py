"""One rank of ringtrain.spark.run / ringtrain.ray.run, as its own 1-rank MPI job:

    RANK=1 WORLD_SIZE=2 MASTER_ADDR=... MASTER_PORT=... mpiexec -n 1 python -m ringtrain.launch.task_worker IN OUT

IN holds cloudpickle.dumps((fn, args, kwargs)); fn calls ringtrain.init() (which joins the WORLD_SIZE processes into
one world, launchers/join.py). OUT receives pickle.dumps(("ok", cloudpickle.dumps(value))) or ("error", text).
A failure exits at once (os._exit): waiting in shutdown or MPI_Finalize for peers that wait for us would hang.
"""
import os
import pickle
import sys
import traceback


def main(payload_path, result_path):
    import cloudpickle
    rank = os.environ.get("RANK", "?")
    try:
        with open(payload_path, "rb") as f:
            fn, args, kwargs = cloudpickle.load(f)
        value = cloudpickle.dumps(fn(*args, **kwargs))
    except BaseException as error:     # noqa: BLE001 -- reported to the driver, with the traceback
        text = f"{type(error).__name__}: {error}\n{traceback.format_exc()}"
        _write(result_path, ("error", text))
        sys.stderr.write(f"ringtrain rank {rank} failed: {text}")
        sys.stderr.flush()
        os._exit(1)
    _write(result_path, ("ok", value))
    from ringtrain.core.state import shutdown
    shutdown()                         # collective: every rank returned from fn


def _write(path, record):
    with open(path + ".tmp", "wb") as f:
        pickle.dump(record, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main(*sys.argv[1:3])
