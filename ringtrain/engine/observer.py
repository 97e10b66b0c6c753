"""What a job is doing, as one engine sees it: its flight recorder (flight_recorder.py), its straggler scores
(stragglers.py) and the failures the ranks agreed on -- kept for the user (straggler_report(), the dumps, the
metrics) and never on the way of a collective beyond a few stores.
"""
import logging
import os
import time

from .flight_recorder import FlightRecorder, default_dir
from .stragglers import Stragglers

log = logging.getLogger("ringtrain")


class Observer:
    """One engine's flight recorder, straggler scores and failure counts."""

    def __init__(self, ctrl, topology, config, agreement, timeline_of):
        """Collective over ctrl (every rank's host; the job's name from rank 0)."""
        self.rank = ctrl.Get_rank()
        self.hosts = ctrl.allgather(topology.host)
        job = ctrl.bcast(time.strftime("%Y%m%d-%H%M%S-") + str(os.getpid()) if self.rank == 0 else None, root=0)
        if not config.flight_recorder_dir:      # one directory for the job (process sets' engines inherit it)
            config.flight_recorder_dir = default_dir(job)
        self.recorder = FlightRecorder(config.flight_recorder_size, self.rank, len(self.hosts),
                                       config.flight_recorder_dir)
        exchange = getattr(agreement, "_exchange", None)      # none on the coordinator protocol: no scores
        self.stragglers = None if exchange is None else Stragglers(exchange, self.rank, self.hosts, config,
                                                                   timeline_of)
        agreement.stragglers = self.stragglers
        self.counts = {"stalls": 0, "mismatches": 0}     # failures agreed by the ranks, for the metrics

    def name_as(self, label):
        """A process set's engine: its dumps and log lines say which set (rank<r>.processset<id>.json)."""
        self.recorder.label = label
        if self.stragglers is not None:
            self.stragglers.label = label

    def observe(self, now):
        """The background thread, between passes: judge the straggler window when it is over."""
        if self.stragglers is not None:
            self.stragglers.maybe_judge(now)

    def dump(self, reason, directory=None):
        """Write this rank's flight recorder; returns the path or None."""
        recorder = self.recorder
        if not recorder.capacity:
            return None
        path = recorder.dump(reason, directory)
        if path is not None:
            log.warning("rank %d: flight recorder (last %d collectives) written to %s: %s", self.rank,
                        min(recorder.seq, recorder.capacity), path, str(reason)[:200])
        return path

    def agreed_failure(self, action):
        """A Failed action (every rank gets it: a stall, a mismatch, a collective a rank shut down without): count
        it, write the flight recorder, and return the message this rank's error carries (pointing at the dumps)."""
        if action.error == "StallError":
            self.counts["stalls"] += 1
        elif action.error == "TensorMismatchError":
            self.counts["mismatches"] += 1
        self.dump(f"{action.error}: {action.message}")
        return action.message + self.hint()

    def hint(self):
        if not self.recorder.capacity:
            return ""
        return f" (each rank's last collectives: python -m ringtrain.doctor {self.recorder.directory})"

    def pending_summary(self, limit=3):
        """What this rank is in: its unfinished collectives, by name and sequence number."""
        entries = self.recorder.entries()
        pending = [e for e in entries if e["state"] in ("submitted", "running")][-limit:]
        if pending:
            return f"rank {self.rank} is in " + ", ".join(f"{e['name']!r} (#{e['seq']})" for e in pending)
        if entries:
            return f"rank {self.rank} last completed #{entries[-1]['seq']} {entries[-1]['name']!r}"
        return f"rank {self.rank} has run no collective"
