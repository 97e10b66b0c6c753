"""Timeline (Chrome trace) and the shutdown communication summary (stats.py): single process, no MPI."""
import json
import types

import numpy as np
import pytest

from ringtrain import stats as stats_module
from ringtrain.config import Config
from ringtrain.stats import CommStats, human_bytes
from ringtrain.timeline import PHASES, Timeline, load_events, open_timeline, timeline_path


def _write_one_tensor_and_bucket(path):
    tl = Timeline(str(path), rank=0)
    t0 = 100.0
    for i, phase in enumerate(PHASES):
        tl.span("grad.fc1.weight", phase, t0 + i * 0.001, t0 + (i + 1) * 0.001, bytes=4096)
    tl.span("grad.fc1.bias", "ring", t0, t0 + 0.002)
    tl.bucket(7, t0 + 0.002, t0 + 0.004, nbytes=8_000_000, names=["grad.fc1.weight", "grad.fc1.bias"],
              transport="shm")
    return tl


def test_timeline_is_valid_chrome_trace_with_every_phase(tmp_path):
    path = tmp_path / "trace.json"
    _write_one_tensor_and_bucket(path).close()
    doc = json.loads(path.read_text())          # strict JSON once closed
    events = doc["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}

    weight = [e for e in spans if e["args"].get("tensor") == "grad.fc1.weight"]
    assert [e["name"] for e in weight] == list(PHASES)
    assert {tracks[e["tid"]] for e in weight} == {"grad.fc1.weight"}       # one track per tensor
    bias = [e for e in spans if e["args"].get("tensor") == "grad.fc1.bias"]
    assert tracks[bias[0]["tid"]] == "grad.fc1.bias" and bias[0]["tid"] != weight[0]["tid"]
    # microseconds, consecutive phases
    assert weight[1]["ts"] - weight[0]["ts"] == pytest.approx(1000.0, abs=0.01)
    assert weight[0]["dur"] == pytest.approx(1000.0, abs=0.01)


def test_bucket_event_reports_bytes_and_bandwidth(tmp_path):
    path = tmp_path / "trace.json"
    _write_one_tensor_and_bucket(path).close()
    (bucket,) = [e for e in load_events(path) if e["name"] == "bucket 7"]
    assert bucket["args"]["bytes"] == 8_000_000
    assert bucket["args"]["GB/s"] == pytest.approx(4.0)          # 8 MB in 2 ms
    assert bucket["args"]["names"] == ["grad.fc1.weight", "grad.fc1.bias"]
    assert bucket["args"]["transport"] == "shm"
    assert bucket["dur"] == pytest.approx(2000.0, abs=0.01)


def test_unclosed_timeline_is_still_readable(tmp_path):
    path = tmp_path / "trace.json"
    tl = _write_one_tensor_and_bucket(path)
    tl._file.flush()                            # as after a crash: written, never closed
    with pytest.raises(json.JSONDecodeError):
        json.loads(path.read_text())
    assert len([e for e in load_events(path) if e["ph"] == "X"]) == len(PHASES) + 2
    tl.close()
    tl.close()                                  # idempotent; later spans are ignored, not errors
    tl.span("late", "ring", 0.0, 1.0)
    assert json.loads(path.read_text())["traceEvents"]


def test_unknown_phase_is_rejected_with_its_name(tmp_path):
    tl = Timeline(str(tmp_path / "t.json"), rank=0)
    with pytest.raises(ValueError, match="'reduce'.*'w'"):
        tl.span("w", "reduce", 0.0, 1.0)
    tl.close()


def test_which_ranks_write_where(tmp_path):
    assert timeline_path("", 0, False) is None
    assert timeline_path("t.json", 0, False) == "t.json"
    assert timeline_path("t.json", 1, False) is None
    assert timeline_path("out/t.json", 3, True) == "out/t.rank3.json"
    cfg = Config(timeline=str(tmp_path / "t.json"), timeline_all_ranks=True)
    tl = open_timeline(cfg, 2)
    tl.close()
    assert (tmp_path / "t.rank2.json").exists()
    assert open_timeline(Config(), 0) is None


# ---- stats.py: the per-op summary printed at shutdown() ----

class _FakeComm:
    """Stands in for an mpi4py communicator: rank 0's gather returns this rank's payload plus preset peers'."""

    def __init__(self, peers):
        self.peers = peers

    def gather(self, obj, root=0):
        return [obj] + self.peers

    def Get_size(self):
        return 1 + len(self.peers)


def test_summary_numbers_single_rank():
    s = CommStats()
    durations = np.arange(1, 201) * 1e-3           # 1..200 ms
    for d in durations:
        s.record("allreduce", 1024, d)
    s.record("broadcast", 10, 0.5)
    rows = {r["op"]: r for r in s.rows()}
    ar = rows["allreduce"]
    assert ar["count"] == 200 and ar["bytes"] == 200 * 1024
    assert ar["mean_s"] == pytest.approx(durations.mean())
    assert ar["p99_s"] == pytest.approx(np.percentile(durations, 99))
    assert ar["slowest_rank"] == 0
    assert rows["broadcast"]["count"] == 1 and rows["broadcast"]["mean_s"] == pytest.approx(0.5)
    table = s.summary()
    assert "allreduce" in table and "200.0 KiB" in table and "100.500" in table   # mean 100.5 ms


def test_summary_gathers_ranks_and_names_the_slowest():
    ranks = [CommStats() for _ in range(3)]
    for r, s in enumerate(ranks):
        for _ in range(10):
            s.record("allreduce", 100, 0.001 * (1 + 2 * (r == 2)))   # rank 2 takes 3 ms, others 1 ms
    ranks[1].record("allgather", 5, 0.01)                             # op kinds seen on some ranks only
    comm = _FakeComm([ranks[1].local(), ranks[2].local()])
    rows = {r["op"]: r for r in ranks[0].rows(comm)}
    assert rows["allreduce"]["slowest_rank"] == 2
    assert rows["allreduce"]["slowest_mean_s"] == pytest.approx(0.003)
    assert rows["allreduce"]["mean_s"] == pytest.approx(0.05 / 30)
    assert rows["allreduce"]["count"] == 10 and rows["allreduce"]["bytes"] == 1000
    assert rows["allgather"]["slowest_rank"] == 1
    assert "3 ranks" in ranks[0].summary(comm)


def test_non_root_ranks_get_empty_summary():
    comm = types.SimpleNamespace(gather=lambda obj, root=0: None, Get_size=lambda: 2)
    s = CommStats()
    s.record("allreduce", 1, 1.0)
    assert s.summary(comm) == ""


def test_reservoir_bounds_memory_and_keeps_p99_close(monkeypatch):
    monkeypatch.setattr(stats_module, "RESERVOIR_SIZE", 1000)
    s = CommStats()
    values = np.random.default_rng(0).exponential(1.0, 20000)
    for v in values:
        s.record("allreduce", 1, v)
    assert len(s.local()["allreduce"]["samples"]) == 1000
    (row,) = s.rows()
    assert row["count"] == 20000 and row["mean_s"] == pytest.approx(values.mean())
    assert row["p99_s"] == pytest.approx(np.percentile(values, 99), rel=0.25)


def test_empty_summary_and_byte_units():
    assert "no collectives" in CommStats().summary()
    assert human_bytes(0) == "0 B" and human_bytes(1536) == "1.5 KiB" and human_bytes(3 << 30) == "3.0 GiB"
