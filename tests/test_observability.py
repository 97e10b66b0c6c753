"""The flight recorder and its merged report, and the metrics endpoint: the report's reading of the ranks' dumps
(single process, made-up dumps), and real 2-rank jobs -- a desync in numpy, torch and TensorFlow programs named by
the report ringtrain-run prints, and a job whose endpoint is scraped over HTTP while it runs.
(The straggler scores run at 2, 3 and 4 ranks in tests/parallel/test_observability.py.)"""
import json
import os
import random
import socket
import subprocess
import sys

import numpy as np
import pytest

from extras import need
from ringtrain import doctor
from ringtrain.engine.flight_recorder import FINISHED, FlightRecorder
from ringtrain.engine.model import Meta

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(REPO, "tests")
JOB_TIMEOUT_S = 120


# ---- the report, from made-up dumps ----------------------------------------------------------------------------
def _dump(directory, rank, size, collectives, reason="StallError: stall"):
    """collectives: [(name, state)] numbered #1.. in order."""
    entries = [{"seq": i + 1, "name": name, "kind": "allreduce", "op": "Sum", "shape": [4], "dtype": "float32",
                "device": "cpu", "root": -1, "state": state, "error": None, "submitted": 1.0, "started": None,
                "finished": None} for i, (name, state) in enumerate(collectives)]
    record = {"format": 1, "rank": rank, "size": size, "label": "", "host": "h", "pid": 1, "time": 1.0,
              "reason": reason, "last_seq": len(collectives), "capacity": 8, "collectives": entries}
    with open(os.path.join(directory, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)


def test_the_report_names_the_rank_that_is_behind(tmp_path):
    done = [("loss", "completed"), ("grads.bucket0", "completed")]
    for r in (0, 1, 3):
        _dump(tmp_path, r, 4, done + [("grads.bucket1", "submitted")])
    _dump(tmp_path, 2, 4, done[:1])
    text = doctor.report(str(tmp_path))
    assert ("ranks diverged at #2: ranks 0,1,3 are in 'grads.bucket0' (#2)" not in text)   # they completed it
    assert "ranks diverged at #2: ranks 0,1,3 completed 'grads.bucket0' (#2) and are in 'grads.bucket1' (#3); " \
           "rank 2 last completed #1 'loss' and has not submitted #2" in text, text


def test_the_report_names_ranks_that_called_different_collectives(tmp_path):
    _dump(tmp_path, 0, 3, [("a", "completed"), ("b", "submitted")])
    _dump(tmp_path, 1, 3, [("a", "completed"), ("b", "submitted")])
    _dump(tmp_path, 2, 3, [("a", "completed"), ("c", "submitted")])
    text = doctor.report(str(tmp_path))
    assert "ranks diverged at #2: ranks 0,1 are in 'b' (#2); rank 2 is in 'c' (#2)" in text, text


def test_the_report_says_when_every_rank_is_in_the_same_collective(tmp_path):
    for r in range(2):
        _dump(tmp_path, r, 3, [("a", "completed"), ("b", "running")])
    text = doctor.report(str(tmp_path))
    assert "no divergence" in text and "'b' (#2)" in text and "no flight recorder file from rank 2" in text, text
    assert doctor.main([str(tmp_path / "nowhere")]) == 2


def test_a_dump_holds_the_last_collectives_in_order(tmp_path):
    """The ring keeps the last `capacity` collectives, oldest first, the latest one included, finished or not."""
    recorder = FlightRecorder(4, rank=0, size=2, directory=str(tmp_path))
    meta = Meta("allreduce", "float32", (4,), op=1)
    for i in range(6):
        entry = recorder.begin(f"t{i}", meta, 1.0 + i)
        entry[FINISHED] = 2.0 + i
    recorder.begin("t6", meta, 9.0)                   # still in flight when the dump is written
    with open(recorder.dump("requested")) as f:
        record = json.load(f)
    names = [(e["seq"], e["name"], e["state"]) for e in record["collectives"]]
    assert names == [(4, "t3", "completed"), (5, "t4", "completed"), (6, "t5", "completed"), (7, "t6", "submitted")]
    retracted = recorder.begin("t7", meta, 10.0)
    recorder.retract(retracted)
    assert recorder.seq == 7 and recorder.entries()[-1]["name"] == "t6"


def test_drained_compiled_calls_keep_the_ring_in_call_order(tmp_path):
    """add_finished (the compiled calls' drain): more calls than the ring holds keep their sequence numbers and only
    the last `capacity` are in the ring, in call order, times in seconds; an entry recorded after the calls (by a
    thread that disarmed the compiled call) moves behind them."""
    recorder = FlightRecorder(4, rank=0, size=2, directory=str(tmp_path))
    meta = Meta("allreduce", "float32", (4,), op=1)
    recorder.begin("before", meta, 0.5)[FINISHED] = 0.75
    since = recorder.seq
    recorder.begin("after", meta, 20.0)                # recorded once the compiled call was disarmed
    keys = {7: ("a", meta), 9: ("b", meta)}
    cids = [7, 9, 7, 7, 9, 9]
    recorder.add_finished(keys, cids, [int(i * 1e9) for i in range(6)], [int((i + 0.5) * 1e9) for i in range(6)],
                          since)
    assert recorder.seq == since + len(cids) + 1
    got = [(e["seq"], e["name"], e["submitted"] - recorder.entries()[0]["submitted"] + 3.0) for e in
           recorder.entries()]
    assert [(seq, name) for seq, name, _ in got] == [(5, "a"), (6, "b"), (7, "b"), (8, "after")], got
    assert [round(t, 3) for _, _, t in got[:3]] == [3.0, 4.0, 5.0], got
    recorder.add_finished(keys, [], [], [], recorder.seq)
    assert recorder.seq == 8


def test_the_recorder_follows_a_handle_without_keeping_its_result(tmp_path):
    """A recorded request's entry learns how its handle ended, and holds neither the handle nor its result: a
    result the caller dropped is freed (the ring would otherwise keep `capacity` results alive)."""
    import gc
    import weakref
    from ringtrain.engine.handle import Handle
    recorder = FlightRecorder(8, rank=0, size=2, directory=str(tmp_path))
    meta = Meta("allreduce", "float32", (1 << 20,), op=1)
    done, failed, running = Handle(["a"]), Handle(["b"]), Handle(["c"])
    for name, handle in (("a", done), ("b", failed), ("c", running)):
        recorder.begin(name, meta, handle.times["submitted"], handle)
    result = np.ones(1 << 20, np.float32)
    done._set_result(result)
    failed._set_error(RuntimeError("planted"))
    states = {e["name"]: (e["state"], e["error"]) for e in recorder.entries()}
    assert states == {"a": ("completed", None), "b": ("failed", "RuntimeError: planted"), "c": ("submitted", None)}
    freed = weakref.ref(result)
    del result, done
    gc.collect()
    assert freed() is None, "the flight recorder keeps a finished collective's result alive"


# ---- real jobs -----------------------------------------------------------------------------------------------
def _env(**extra):
    env = dict(os.environ, RINGTRAIN_STALL_WARNING_S="1", RINGTRAIN_STALL_TIMEOUT_S="2", OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, os.path.join(TESTS, "fault_scripts"),
                                                      env.get("PYTHONPATH", "")]))
    env.update(extra)
    return env


def _launch(args, timeout=JOB_TIMEOUT_S, **env):
    return subprocess.run([sys.executable, "-m", "ringtrain.launch.run", *args], env=_env(**env), cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
def test_a_skipped_collective_is_named_by_the_merged_report(tmp_path):
    """In a numpy, a torch and a TensorFlow program (one job, a fresh world each), rank 1 skips 'step2.forward',
    the 5th collective: the merged report says where the ranks diverged and who is in what -- printed by
    ringtrain-run for the numpy one, by python -m ringtrain.doctor for the others; the stall error points at the
    dumps; the job goes on and ends cleanly."""
    frameworks = ["numpy"] + [f for f in ("torch", "tensorflow") if _importable(f)]
    # the skipping rank submits its next call once warned that the skipped one waits (desync.py): from that warning
    # (0.25 s, then up to a stall check period of 0.5 s) to the stall (past 1.5 s, at a check) it has a second or
    # more to submit it, so its flight recorder is in 'step2.grads' when the stall makes it write the dump
    proc = _launch(["-np", "2", sys.executable, os.path.join(TESTS, "fault_scripts", "desync.py"), *frameworks],
                   RINGTRAIN_FLIGHT_RECORDER_DIR=str(tmp_path), RINGTRAIN_STALL_TIMEOUT_S="1.5",
                   RINGTRAIN_STALL_WARNING_S="0.25")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    verdict = "ranks diverged at #5: rank 0 is in 'step2.forward' (#5); rank 1 is in 'step2.grads' (#5)"
    assert f"flight recorder report ({tmp_path})" in out and verdict in out, out[-4000:]
    for framework in frameworks:
        assert f"rank 0: CAUGHT[{framework} step2.forward] StallError: stall: tensor 'step2.forward'" in out, out
        if framework != "numpy":
            directory = tmp_path / framework
            assert f"python -m ringtrain.doctor {directory}" in out
            cli = subprocess.run([sys.executable, "-m", "ringtrain.doctor", str(directory)], env=_env(),
                                 capture_output=True, text=True, timeout=60)
            assert verdict in cli.stdout, cli.stdout + cli.stderr
    assert frameworks == ["numpy", "torch", "tensorflow"], "torch or TensorFlow is not installed"


def _importable(module):
    import importlib.util
    return importlib.util.find_spec(module) is not None


def _free_ports(count):
    for _ in range(50):
        base = random.randrange(20000, 60000)
        try:
            sockets = []
            for port in range(base, base + count):
                s = socket.socket()
                s.bind(("127.0.0.1", port))
                sockets.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    pytest.skip("no free ports")


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
def test_the_metrics_endpoint_counts_what_the_job_ran(tmp_path):
    """Scraped over HTTP during a 2-rank job (observe_scripts/metrics_scrape.py checks the numbers: counts and bytes
    per kind on every rank, moving between two scrapes; a SIGUSR1 dump ending with the last collective), and the
    text files each rank leaves."""
    need("prometheus_client")
    port = _free_ports(2)
    path = tmp_path / "metrics.prom"
    flight = tmp_path / "flight"
    proc = _launch(["-np", "2", sys.executable, os.path.join(TESTS, "observe_scripts", "metrics_scrape.py"),
                    str(port), str(path), str(flight)], RINGTRAIN_METRICS_PORT=str(port),
                   RINGTRAIN_METRICS_FILE=str(path), RINGTRAIN_FLIGHT_RECORDER_DIR=str(flight))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for line in ("rank 0: OK first scrape", "rank 0: OK second scrape", "rank 0: OK dump", "rank 1: OK dump"):
        assert line in out, out[-4000:]
    for rank, name in ((0, "metrics.prom"), (1, "metrics.rank1.prom")):
        text = (tmp_path / name).read_text()
        assert f'ringtrain_collectives_total{{kind="allreduce",process_set="0",rank="{rank}"}} 13.0' in text, text


def test_an_abandoned_world_hands_its_metrics_port_to_the_next_one():
    """An elastic job leaves a world with abandon() and starts the next with init(): the endpoint moves with it
    (the port stays usable; the next world's engine counts from zero, the process's elastic counters go on).
    In a process of its own: in pytest's, an earlier test may have left ringtrain initialised, and init() is then
    a no-op that would not serve the port."""
    need("prometheus_client")
    port = _free_ports(1)
    proc = subprocess.run([sys.executable, os.path.join(TESTS, "observe_scripts", "metrics_two_worlds.py"), str(port)],
                          capture_output=True, text=True, timeout=JOB_TIMEOUT_S, cwd=REPO)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "OK world 0" in out and "OK world 1" in out, out[-4000:]
