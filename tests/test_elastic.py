"""Elastic jobs with real worker processes: `ringtrain-run` in elastic mode starts each worker as its own MPI job
(tests/elastic_scripts/), and the cases kill, add and refuse workers. Every job has a hard timeout (its process
group is killed and the test fails with the output), so nothing here can hang CI.

What each asserts: the kill case (in the Keras and different-commits cases one survivor learns of the death a batch
before the other, so they roll back from different points) -- after the roll-back every survivor's state equals its last commit bit for bit, each survivor
rolls back once (no second re-form from ranks that went on out of step), the job finishes on the survivors, and
the epoch trains every sample exactly once (counts == 1); the join case --
a worker added by the discovery script joins at a commit and every rank is bit-identical after sync(); below
--min-np the job ends with the error after --elastic-timeout; a worker failing at start is blacklisted and the job
goes on without it.
"""
import os
import re
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_jobs import HARD_KILL_S, REPO, SCRIPTS, needs_mpiexec, run_elastic

pytestmark = needs_mpiexec


def test_sigkilled_worker_survivors_rolled_back_to_different_commits_all_go_on_from_rank_0s_state(tmp_path):
    """A SIGKILLed worker: the survivors roll back to their commits (bit for bit) and finish in a world of 2, every
    sample trained exactly once. Here it dies once step 3 returned everywhere: rank 2 records it and saves the commit
    that follows (whose collective check then fails), while rank 0 learns of the death first and rolls back to the
    commit before. Every rank must take rank 0's state, its sampler record included, so steps 2-3 are trained
    again."""
    # Rank 0, idle in fail_with_the_world, follows rank 2 into the commit's check cycle on its engine thread after
    # the driver told it of the death: that cycle must end in the abort, not in a send to the dead rank (which
    # crashes inside MPICH)
    job = run_elastic("-np", "3", "--min-np", "2", KILL_RANK=1, KILL_AFTER_STEP=3, LATE_RANK=0,
                      STEP_MARKS_DIR=tmp_path)
    assert job.returncode == 0, job
    assert "rank 1: KILLED" in job.output, job
    # the driver names the death by what it sees first: the worker's connection closing, or its process's end
    assert re.search(r"worker localhost\[\d\] \(rank 1 of world 1\) (?:lost its connection|exited with code|was "
                     r"killed).*2 workers left", job.output), job
    assert "world 2: 2 workers" in job.output, job
    restored = job.lines("RESET")
    assert sorted(restored) == [0, 1] and {len(lines) for lines in restored.values()} == {1}, job
    assert restored[0][0]["committed"] != restored[1][0]["committed"], job     # two different commits
    for lines in restored.values():
        assert lines[0]["live"] == lines[0]["committed"] != "None", job
    final = job.lines("FINAL")
    assert sorted(final) == [0, 1] and {f[0]["counts"] for f in final.values()} == {"ok"}, job
    assert {f[0]["size"] for f in final.values()} == {"2"}, job
    assert len({f[0]["digest"] for f in final.values()}) == 1, job


def test_a_survivors_exchange_in_flight_with_the_worker_that_died_leaves_it_alive():
    """MPI as the driver sets it up for workers: messages in flight between a survivor and a worker that dies never
    complete, and the survivor's MPI progress goes on (MPICH aborted it on libfabric's default provider); the driver's
    word ends its wait. A send to the dead worker afterwards does not crash it (MPICH's ucx module did, inside
    MPI_Isend); on libfabric's tcp provider it blocks (ringtrain sends nothing once it knows of a death)."""
    job = run_elastic("-np", "2", "--min-np", "1", script="send_to_the_dead.py")
    assert re.search(r"^rank 0: SURVIVED the exchange in flight$", job.output, re.M), job
    assert re.search(r"^rank 0: SEND TO THE DEAD (returned|raised|blocked)", job.output, re.M), job
    assert "Abort(" not in job.output, job


def test_waits_drive_mpi_progress_without_peer_checks():
    """Each rank's waits move MPI's data (an elastic world's network module moves it only inside MPI calls), not only
    the Watchdog's peer checks: with those pushed out of reach the broadcasts and allreduces still complete."""
    job = run_elastic("-np", "3", "--min-np", "3", script="progress_between_mpi_calls.py",
                      RINGTRAIN_PEER_CHECK_S=1e6, RINGTRAIN_STALL_TIMEOUT_S=20)
    assert job.returncode == 0, job
    steps = job.lines("STEP")
    assert sorted(steps) == [0, 1, 2] and all(len(s) == 3 and {x["ok"] for x in s} == {"True"}
                                           for s in steps.values()), job


def _discovery_script(tmp_path, hosts):
    hosts_file = tmp_path / "hosts"
    hosts_file.write_text(hosts)
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts_file}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script, hosts_file


def test_worker_added_by_discovery_joins_at_a_commit_and_gets_the_state(tmp_path):
    script, hosts_file = _discovery_script(tmp_path, "localhost:2\n")
    job = run_elastic("-np", "2", "--min-np", "2", "--max-np", "3", "--host-discovery-script", str(script),
                      GROW_HOSTS_FILE=hosts_file, GROW_STEP=3)
    assert job.returncode == 0, job
    assert re.search(r"world 2: 3 workers; joined: localhost\[2\]", job.output), job
    for lines in job.lines("RESET").values():                   # a join rolls nothing back
        assert all(r["live"] == r["committed"] for r in lines), job
    starts = job.lines("START")
    after = {rank: [s for s in lines if s["size"] == "3"] for rank, lines in starts.items()}
    assert sorted(r for r, s in after.items() if s) == [0, 1, 2], job
    digests = {s[0]["digest"] for s in after.values() if s}
    assert len(digests) == 1, job                                # bit-identical on every rank after sync()
    first = {s["digest"] for lines in starts.values() for s in lines if s["size"] == "2"}
    assert digests.isdisjoint(first), job                        # ... and it is the trained state, not the initial
    final = job.lines("FINAL")
    assert sorted(final) == [0, 1, 2] and {f[0]["counts"] for f in final.values()} == {"ok"}, job
    assert len({f[0]["digest"] for f in final.values()}) == 1, job


def test_below_min_np_ends_with_a_clear_error_after_the_elastic_timeout():
    # the cooldown lets the host back in after 600 s, so waiting could help: the job waits --elastic-timeout
    job = run_elastic("-np", "2", "--min-np", "2", "--elastic-timeout", "2", "--blacklist-cooldown-range", "600",
                      "700", KILL_RANK=1, KILL_STEP=3)
    assert job.returncode != 0, job
    assert re.search(r"1 worker\(s\) ready, below --min-np 2: waiting up to 2 s", job.output), job
    assert re.search(r"elastic job failed: only 1 worker\(s\) for 2 s \(--elastic-timeout\), fewer than "
                     r"--min-np 2", job.output), job
    assert job.seconds < 60, job
    assert not job.lines("FINAL"), job


def test_below_min_np_with_every_host_blacklisted_for_good_ends_at_once():
    job = run_elastic("-np", "2", "--min-np", "2", "--elastic-timeout", "90", KILL_RANK=1, KILL_STEP=3)
    assert job.returncode != 0, job
    assert re.search(r"elastic job failed: only 1 worker\(s\) left, fewer than --min-np 2, and no host can start "
                     r"another: every host is blacklisted for good", job.output), job
    assert "waiting up to" not in job.output, job
    assert job.seconds < 60, job
    assert not job.lines("FINAL"), job


def test_worker_failing_at_start_is_blacklisted_and_the_job_goes_on():
    job = run_elastic("-np", "3", "--min-np", "2", "-H", "127.0.0.1:2,127.0.0.2:1",
                      "--blacklist-cooldown-range", "1", "2", FAIL_AT_START_ON_HOST="127.0.0.2")
    assert job.returncode == 0, job
    assert re.search(r"worker 127\.0\.0\.2\[0\] before joining a world exited with code 3; host 127\.0\.0\.2 "
                     r"blacklisted for \d+ s", job.output), job
    assert "world 1: 2 workers" in job.output, job
    final = job.lines("FINAL")
    assert sorted(final) == [0, 1] and {f[0]["counts"] for f in final.values()} == {"ok"}, job
    assert {f[0]["size"] for f in final.values()} == {"2"}, job


def _keras_available():
    try:
        import keras  # noqa: F401
        import tensorflow  # noqa: F401
    except ImportError:
        return False
    return True


keras_only = pytest.mark.skipif(not _keras_available(),
                                reason="TensorFlow/Keras are missing: the [tensorflow] extra is not installed")


@keras_only
def test_keras_fit_sigkilled_worker_survivors_roll_back_and_finish():
    # rank 2 fails before batch 2's end callbacks, rank 0 in batch 3: the survivors' CommitStateCallbacks had
    # counted different numbers of batches, and must still commit at the same batches of the next world
    job = run_elastic("-np", "3", "--min-np", "2", script="train_keras.py", KILL_RANK=1, KILL_STEP=3, LATE_RANK=2)
    assert job.returncode == 0, job
    assert "world 2: 2 workers" in job.output, job
    restored = job.lines("RESET")
    assert sorted(restored) == [0, 1], job
    for lines in restored.values():
        assert len(lines) == 1 and lines[0]["live"] == lines[0]["committed"] != "None", job
    final = job.lines("FINAL")
    assert sorted(final) == [0, 1] and {f[0]["counts"] for f in final.values()} == {"ok"}, job
    assert {f[0]["size"] for f in final.values()} == {"2"}, job
    assert len({f[0]["digest"] for f in final.values()}) == 1, job


@keras_only
def test_keras_fit_worker_added_by_discovery_joins_and_gets_the_state(tmp_path):
    # CommitStateCallback's commit raises the interrupt: after the join the survivors and the new worker (whose
    # callback is fresh) must count batches alike, or their next commits meet gradient allreduces
    script, hosts_file = _discovery_script(tmp_path, "localhost:2\n")
    job = run_elastic("-np", "2", "--min-np", "2", "--max-np", "3", "--host-discovery-script", str(script),
                      script="train_keras.py", GROW_HOSTS_FILE=hosts_file, GROW_STEP=2)
    assert job.returncode == 0, job
    assert re.search(r"world 2: 3 workers; joined: localhost\[2\]", job.output), job
    after = [s for lines in job.lines("START").values() for s in lines if s["size"] == "3"]
    assert len(after) == 3 and len({s["digest"] for s in after}) == 1, job
    final = job.lines("FINAL")
    assert sorted(final) == [0, 1, 2] and {f[0]["counts"] for f in final.values()} == {"ok"}, job
    assert len({f[0]["digest"] for f in final.values()}) == 1, job


def run_example(script, *args, launcher=("-np", "3", "--min-np", "2")):
    """An examples/ script under ringtrain-run's elastic mode, from the examples directory (its data helper)."""
    environ = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")])))
    cmd = [sys.executable, "-m", "ringtrain.launch.run", *launcher, sys.executable, script, *args]
    proc = subprocess.Popen(cmd, cwd=REPO / "examples", env=environ, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=HARD_KILL_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"{script} still running after {HARD_KILL_S}s:\n{proc.communicate()[0][-12000:]}")
    assert proc.returncode == 0, out[-12000:]
    return out


@pytest.mark.parametrize("script", ["elastic_train.py", pytest.param("keras_elastic_train.py", marks=keras_only)])
def test_example_survives_a_killed_worker_and_takes_in_a_new_one(script, tmp_path):
    """The examples README's command with --demo-kill: rank 2 dies in epoch 2, the job learns on with 2 workers, and
    a new worker started on the freed slot (the host's cooldown over) joins and trains to the end. The pace (only
    while the world is short of a worker) leaves the new worker 4 epochs x 15 steps x 0.5 s to start; it must join
    with 2 epochs or more left, and the job must have learnt (chance is 0.1; the first epoch's accuracy 0.1-0.3)."""
    discover, _ = _discovery_script(tmp_path, "localhost:3\n")
    out = run_example(script, "--demo-kill", "2", "--epochs", "6", "--demo-pace", "0.5",
                      launcher=("-np", "3", "--min-np", "2", "--max-np", "3", "--host-discovery-script",
                                str(discover), "--blacklist-cooldown-range", "1", "1"))
    assert "world 2: 2 workers" in out, out[-12000:]
    assert re.search(r"world 3: 3 workers; joined: localhost\[2\]", out), out[-12000:]
    assert "world 4:" not in out, out[-12000:]            # the worker that took rank 2's slot is not killed again
    # an epoch's line is missing when the world changed during its test pass (it re-forms and goes on)
    epochs = {int(e): (int(w), float(a)) for e, w, a in
              re.findall(r"^epoch +(\d+)/6  workers (\d)  .*test accuracy ([0-9.]+)$", out, re.M)}
    assert epochs.get(1, (0,))[0] == 3, out[-12000:]
    assert epochs.get(5, (0,))[0] == 3 and epochs.get(6, (0,))[0] == 3, out[-12000:]   # joined 2+ epochs before the end
    final = re.search(r"final: workers (\d+)  epochs (\d+)  test accuracy ([0-9.]+)", out)
    assert final and final.group(1, 2) == ("3", "6"), out[-12000:]
    assert float(final.group(3)) >= 0.7 and float(final.group(3)) >= epochs[1][1] + 0.4, out[-12000:]


def test_reset_limit_ends_the_job_at_the_first_reformation_too_many():
    job = run_elastic("-np", "3", "--min-np", "1", "--reset-limit", "0", KILL_RANK=2, KILL_STEP=3)
    assert job.returncode != 0, job
    assert re.search(r"elastic job failed: the world would be re-formed 1 time\(s\), more than --reset-limit 0",
                     job.output), job
    assert not job.lines("FINAL"), job
