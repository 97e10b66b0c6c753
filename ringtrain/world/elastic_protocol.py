"""The line protocol between the elastic driver (in `ringtrain-run`) and its workers: one JSON object per line over
one TCP connection per worker, which the worker keeps open for its whole life (its close is also how the driver
learns at once that a worker died).

worker -> driver   {"op": "hello", "worker": id, "pid": pid}     first line
                   {"op": "ready"}                                 this worker needs a (new) world
                   {"op": "planned", "generation": g}              got its place in world g, alive (the barrier)
                   {"op": "port", "port": name, "generation": g}   the new world's rank 0 opened this MPI port
                   {"op": "joined", "generation": g}               this worker connected and merged
                   {"op": "form_failed", "generation": g, "reason": text}    its MPI formation call failed
                   {"op": "at_step", "seq": k, "generation": g, "steps": c}    heard hosts_updated k having
                                                                   completed c steps of world g (elastic_boundary)
                   {"op": "exiting"}                               a normal interpreter exit (atexit)
driver -> worker   {"op": "world", "rank": r, "size": n, "generation": g}    your place in the next world
                   {"op": "leave", "reason": text}                 instead of a world: your slot left the host list
                   {"op": "go", "generation": g}                   every planned worker answered: form the world
                   {"op": "abandon", "generation": g}              a planned worker died (or the formation failed):
                                                                   ask again ("ready")
                   {"op": "connect", "port": name, "generation": g}    connect now (one joiner at a time)
                   {"op": "peer_failed", "generation": g, "reason": text}    end your waits on world g
                   {"op": "hosts_updated", "seq": k, "generation": g, "added": bool,
                                                                    "removed": bool}    (about world g)
                   {"op": "stop_at", "seq": k, "generation": g, "steps": T, "added": bool,
                                                                    "removed": bool}    stop world g after step T

Environment the driver gives each worker: DRIVER_VARIABLE (host:port), WORKER_VARIABLE (its id), HOST_VARIABLE and
SLOT_VARIABLE (its slot on that host: which GPU it binds, the same in every world).
Standard library only: the driver runs in the launcher, which must not start MPI.
"""
import json
import os

DRIVER_VARIABLE = "RINGTRAIN_ELASTIC_DRIVER"
WORKER_VARIABLE = "RINGTRAIN_ELASTIC_WORKER"
HOST_VARIABLE = "RINGTRAIN_ELASTIC_HOST"
SLOT_VARIABLE = "RINGTRAIN_ELASTIC_SLOT"
LEAVE_TIMEOUT_VARIABLE = "RINGTRAIN_ELASTIC_LEAVE_TIMEOUT_S"    # a survivor that has not left a failed world by
LEAVE_TIMEOUT_S = 30.0                                          # then exits (a death), see elastic_worker
CONNECT_TIMEOUT_VARIABLE = "RINGTRAIN_ELASTIC_CONNECT_TIMEOUT_S"    # a formation's MPI Accept/Connect gives up by then
CONNECT_TIMEOUT_S = 10.0


def encode(op, **fields):
    return (json.dumps(dict(op=op, **fields)) + "\n").encode()


class LineReader:
    """Splits what arrives on a socket into decoded messages; feed() returns the complete ones."""

    def __init__(self):
        self._pending = b""

    def feed(self, data):
        lines = (self._pending + data).split(b"\n")
        self._pending = lines.pop()
        return [json.loads(line) for line in lines if line.strip()]


def leave_timeout_s(environ=os.environ):
    """How long a survivor may take to leave a failed world before it counts as dead (elastic_worker)."""
    return float(environ.get(LEAVE_TIMEOUT_VARIABLE, LEAVE_TIMEOUT_S))


def connect_timeout_s(environ=os.environ):
    """How long a forming world's MPI Accept (or Connect) waits for its peer before it fails (elastic_worker)."""
    return float(environ.get(CONNECT_TIMEOUT_VARIABLE, CONNECT_TIMEOUT_S))
