"""The flight recorder: each rank's last N collectives, written to a file when something goes wrong.

Every collective this rank's engine is handed gets a sequence number in program order (#1, #2, ...: the same
collective has the same number on every rank of a healthy job) and an entry in a ring buffer: name, kind, op,
shape, dtype, device, when it was submitted, started and finished, and how it ended. Recording is one small list
per collective; a request's entry shares its handle's time stamps and the handle writes how it ended into it
(the entry never holds the handle, nor so its result).

dump() writes the buffer as JSON (rank<r>.json in the job's directory) on a stall, a mismatch, a peer's death, a
signal (SIGUSR1, when ringtrain installed its handler) or ringtrain.dump_flight_recorder(). ringtrain.doctor
merges the ranks' files into one report that says where the ranks diverged.
"""
import json
import logging
import os
import socket
import tempfile
import time

from ..ops import ReduceOp

log = logging.getLogger("ringtrain")

DUMP_FORMAT = 1
MAX_REASONS = 8
FILE_PREFIX = "rank"

# entry fields (a list, so that finishing an express collective is one store)
SEQ, NAME, META, SUBMITTED, TIMES, FINISHED, ERROR = range(7)    # TIMES: the handle's time stamps


def default_dir(job):
    return os.path.join(tempfile.gettempdir(), "ringtrain-flight-recorder", job)


class FlightRecorder:
    """A ring buffer of this engine's last `capacity` collectives (rounded up to a power of two)."""

    def __init__(self, capacity, rank, size, directory, label=""):
        self.capacity = 1 << max(0, int(capacity) - 1).bit_length() if capacity > 0 else 0
        self._mask = self.capacity - 1
        self._ring = [None] * self.capacity
        self.seq = 0                            # sequence number of the last collective recorded
        self.rank, self.size = rank, size
        self.directory = directory
        self.label = label                      # "" for the world's engine, "process set 2" for a set's
        self.dumps = 0
        self.reasons = []                       # why it was written, the first few times (the first one explains)

    def begin(self, name, meta, submitted, handle=None):
        """A collective enters this rank's engine; returns its entry (the express path finishes it itself)."""
        if not self.capacity:
            return None
        seq = self.seq = self.seq + 1
        entry = self._ring[seq & self._mask] = [seq, name, meta, submitted, None, None, None]
        if handle is not None:
            attach(entry, handle)
        return entry

    def add_finished(self, keys, cids, starts_ns, ends_ns, since, write=None):
        """Finished express calls the compiled call ran (fast_state.py), oldest first, all after entry `since` (the
        last seq when it was armed): call i is keys[cids[i]] (name, meta), from starts_ns[i] to ends_ns[i]
        (perf_counter's clock, ns). Only the last `capacity` calls are written (the ring would overwrite the others
        at once): a drain of thousands of calls costs what the ring holds. write: the compiled module's fast_record
        (the same entries as the loop here, at a fraction of its cost per call), else this loop. An entry recorded
        after `since` was recorded after the compiled call was disarmed (every recording thread disarms it first),
        so after all of these: it moves behind them, keeping the ring in call order."""
        if not self.capacity:
            return
        ring, mask, last = self._ring, self._mask, self.seq
        later = [ring[s & mask] for s in range(max(since + 1, last - self.capacity + 1), last + 1)]
        first = max(0, len(cids) - self.capacity)
        if first:
            cids, starts_ns, ends_ns = cids[first:], starts_ns[first:], ends_ns[first:]
        seq = since + first
        if write is not None:
            seq = write(ring, seq, keys, cids, starts_ns, ends_ns)
        else:
            for cid, start, end in zip(cids, starts_ns, ends_ns):
                name, meta = keys[cid]
                seq += 1
                ring[seq & mask] = [seq, name, meta, start * 1e-9, None, end * 1e-9, None]
        for entry in later:
            if entry is not None and entry[SEQ] > since:
                seq += 1
                entry[SEQ] = seq
                ring[seq & mask] = entry
        self.seq = seq

    def retract(self, entry):
        """An express attempt that did nothing after all (it continues as an ordinary request, recorded again)."""
        if entry is not None and entry[SEQ] == self.seq:
            self._ring[self.seq & self._mask] = None
            self.seq -= 1

    def entries(self):
        """The recorded entries, oldest first, as dicts (times in seconds since the epoch)."""
        offset = time.time() - time.perf_counter()
        ring = list(self._ring)                 # a snapshot: the engine may record while we read
        last = self.seq
        out = []
        for seq in range(max(1, last - self.capacity + 1), last + 1):
            entry = ring[seq & self._mask]
            if entry is None or entry[SEQ] != seq:
                continue
            out.append(_describe(entry, offset))
        return out

    def dump(self, reason, directory=None):
        """Write the buffer to <directory>/rank<r>.json (or rank<r>.<label>.json for a process set); returns the
        path, or None when it could not be written (the error is logged, never raised: a dump happens on the way
        to another error)."""
        directory = directory or self.directory
        suffix = "" if not self.label else "." + self.label.replace(" ", "")
        path = os.path.join(directory, f"{FILE_PREFIX}{self.rank}{suffix}.json")
        if len(self.reasons) < MAX_REASONS:
            self.reasons.append(str(reason))
        record = {"format": DUMP_FORMAT, "rank": self.rank, "size": self.size, "label": self.label,
                  "host": socket.gethostname(), "pid": os.getpid(), "time": time.time(), "reason": str(reason),
                  "first_reasons": self.reasons,
                  "last_seq": self.seq, "capacity": self.capacity, "collectives": self.entries()}
        try:
            os.makedirs(directory, exist_ok=True)
            temporary = path + f".{os.getpid()}.tmp"
            with open(temporary, "w", encoding="utf-8") as f:
                json.dump(record, f)
            os.replace(temporary, path)
        except OSError as e:
            log.error("rank %d: could not write the flight recorder to %s: %s", self.rank, path, e)
            return None
        self.dumps += 1
        return path


def attach(entry, handle):
    """The entry follows `handle`: it keeps the handle's time stamps and the handle tells it how it ended
    (finish_record). It holds no reference to the handle, whose result would otherwise outlive its use by as many
    collectives as the ring holds (a 16 MB result then costs fresh pages on every call, and memory)."""
    if entry is None:
        return
    entry[TIMES] = handle.times
    if handle._done:
        finish_record(entry, handle.times.get("finished"), handle._error)
    else:
        handle.record = entry


def finish_record(entry, finished, error):
    entry[FINISHED] = finished
    entry[ERROR] = error


def _describe(entry, offset):
    seq, name, meta, submitted, times, finished, error = entry
    started = None if times is None else times.get("started")
    if error is not None:
        state = "failed"
    elif finished is not None:
        state = "completed"
    elif started is not None:
        state = "running"
    else:
        state = "submitted"
    return {"seq": seq, "name": name, "kind": meta.kind, "op": ReduceOp(meta.op).name.title() if meta.op >= 0 else None,
            "shape": list(meta.shape), "dtype": meta.dtype, "device": meta.device, "root": meta.root,
            "state": state, "error": None if error is None else f"{type(error).__name__}: {error}",
            "submitted": _wall(submitted, offset), "started": _wall(started, offset),
            "finished": _wall(finished, offset)}


def _wall(stamp, offset):
    return None if stamp is None else round(stamp + offset, 6)
