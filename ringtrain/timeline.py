"""Chrome-trace / Perfetto timeline of what the engine did to each tensor and each fusion bucket.

Open the file at https://ui.perfetto.dev or chrome://tracing. One process per rank, one track per tensor name
(its phases queued -> negotiated -> packed -> ring -> unpacked as consecutive slices), one "fusion buckets"
track whose slices carry the bucket's bytes, bandwidth, tensor names and transport, and one "waiting for ranks"
track: each slice a wait of this rank for a late one, named after it ("waiting for rank 3").

The file is written incrementally (events stream out as they happen, so a long run does not hold them in
memory) and is valid JSON once close() has run. A job killed before close() leaves a file missing its final
"]}" -- Perfetto still loads such a file, and `load_events()` below reads it too.

    RINGTRAIN_TIMELINE=trace.json python train.py          # rank 0 writes trace.json
    RINGTRAIN_TIMELINE_ALL_RANKS=1 ...                     # every rank r writes trace.rank{r}.json
"""
import json
import os
import threading
import time

PHASES = ("queued", "negotiated", "packed", "ring", "unpacked")
_BUCKET_TRACK = "fusion buckets"
_WAIT_TRACK = "waiting for ranks"
_FLUSH_EVERY_S = 1.0   # bounded loss if the process dies, without a syscall per event


class Timeline:
    """Streams Chrome-trace events for one rank into `path`. Thread-safe: the engine thread and the
    submitting threads may both record."""

    def __init__(self, path, rank):
        self.path = path
        self.rank = rank
        self._lock = threading.Lock()
        self._epoch = time.perf_counter()      # trace time 0; all stamps come from time.perf_counter()
        self._tracks = {}                      # track name -> tid
        self._first = True
        self._last_flush = time.monotonic()
        self._file = open(path, "w", encoding="utf-8")
        self._file.write('{"displayTimeUnit": "ms", "traceEvents": [\n')
        self._emit({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                    "args": {"name": f"rank {rank}"}})

    @property
    def closed(self):
        return self._file is None

    def span(self, name, phase, start, end, **args):
        """One phase of tensor `name` from `start` to `end` (time.perf_counter() seconds)."""
        if phase not in PHASES:
            raise ValueError(f"timeline phase {phase!r} for tensor {name!r} is not one of {PHASES}")
        with self._lock:
            if self._file is None:
                return
            self._complete(phase, self._track(name), start, end, dict(args, tensor=name))

    def bucket(self, bucket_id, start, end, nbytes, names, transport):
        """One fusion bucket's trip through the ring; args carry its size and achieved bandwidth."""
        seconds = max(end - start, 0.0)
        gbps = nbytes / seconds / 1e9 if seconds > 0 else 0.0
        args = {"bytes": int(nbytes), "GB/s": round(gbps, 3), "tensors": len(names),
                "names": list(names), "transport": transport}
        with self._lock:
            if self._file is None:
                return
            self._complete(f"bucket {bucket_id}", self._track(_BUCKET_TRACK), start, end, args)

    def wait_mark(self, late_rank, start, end):
        """This rank waited from `start` to `end` in the agreement for `late_rank`: a slice named after it on the
        "waiting for ranks" track (the straggler scores count the same waits)."""
        with self._lock:
            if self._file is None:
                return
            self._complete(f"waiting for rank {late_rank}", self._track(_WAIT_TRACK), start, end,
                           {"late rank": int(late_rank), "waited_ms": round((end - start) * 1e3, 3)})

    def close(self):
        with self._lock:
            if self._file is None:
                return
            self._file.write("\n]}\n")
            self._file.close()
            self._file = None

    # internals, called with the lock held
    def _track(self, name):
        tid = self._tracks.get(name)
        if tid is None:
            tid = self._tracks[name] = len(self._tracks) + 1
            self._emit({"ph": "M", "name": "thread_name", "pid": self.rank, "tid": tid, "args": {"name": name}})
            # keep the bucket track on top and tensors in first-seen order
            self._emit({"ph": "M", "name": "thread_sort_index", "pid": self.rank, "tid": tid,
                        "args": {"sort_index": tid}})
        return tid

    def _complete(self, event_name, tid, start, end, args):
        ts = (start - self._epoch) * 1e6
        dur = max(end - start, 0.0) * 1e6
        self._emit({"ph": "X", "name": event_name, "pid": self.rank, "tid": tid,
                    "ts": round(ts, 3), "dur": round(dur, 3), "args": args})

    def _emit(self, event):
        self._file.write(("" if self._first else ",\n") + json.dumps(event, default=str))
        self._first = False
        now = time.monotonic()
        if now - self._last_flush > _FLUSH_EVERY_S:
            self._file.flush()
            self._last_flush = now


def timeline_path(path, rank, all_ranks):
    """Where rank `rank` writes, or None if it does not: rank 0 only, unless all_ranks (then name.rank{r}.ext)."""
    if not path:
        return None
    if not all_ranks:
        return path if rank == 0 else None
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext}"


def open_timeline(config, rank):
    """The Timeline this rank should write per `config` (RINGTRAIN_TIMELINE*), or None."""
    path = timeline_path(config.timeline, rank, config.timeline_all_ranks)
    return Timeline(path, rank) if path else None


def load_events(path):
    """The events of a timeline file, also one cut short by a crash (missing the closing brackets)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        return json.loads(text)["traceEvents"]
    except json.JSONDecodeError:
        return json.loads(text.rstrip().rstrip(",") + "\n]}")["traceEvents"]
