"""Lossless elastic recovery with real worker processes (tests/elastic_scripts/train_lossless.py): a worker is
SIGKILLed at a random moment of a random step, the survivors go on with no commit() anywhere, and the final
parameters and optimizer state equal a one-process replay of exactly the samples the job trained -- each once, with
each step averaged over its own world's size. The step, the moment and the rank are drawn per run (the seed is in
the test's output: RINGTRAIN_TEST_SEED=s reruns one draw). Also Horovod's roll-back mode (commit every 2 steps),
which must end on a replayable trajectory too.

What a wrong recovery looks like here: a sync that drops the optimizer state (the worker that joins starts with
none; a survivor that missed the last step keeps its old momentum), an Average by the old world's size, a sample
lost or trained twice when the samples of the failed step are dealt again, a roll-back of completed steps.
"""
import json
import os
import random
import re

import numpy as np
import pytest

from elastic_jobs import SCRIPTS, needs_mpiexec, run_elastic

pytestmark = needs_mpiexec

KILL_POINTS = ("before", "backward", "in_step", "after_step", "timer")


def draw(workers, last_step=None):
    """(seed, kill rank, kill step, kill point, optimizer): the step among the first world's full steps, past the
    first (up to `last_step`); the optimizer SGD with momentum or Adam (so both run at every size over runs)."""
    seed = int(os.environ.get("RINGTRAIN_TEST_SEED", random.SystemRandom().randrange(1 << 30)))
    rng = random.Random(seed)
    steps = 48 // 2 // workers
    point = rng.choice(KILL_POINTS)
    if point == "timer":
        point = f"timer:{rng.uniform(0.0, 0.012):.4f}"
    step = rng.randrange(1, min(steps - 1, last_step or steps))
    return seed, rng.randrange(workers), step, point, rng.choice(("sgd", "adam"))


def replay(history, optimizer_name):
    """One process, the same steps: each rank's gradient on its own samples, averaged over the step's world size,
    then one optimizer step. Returns (parameters, optimizer state per parameter)."""
    import torch
    namespace = {"__name__": "train_lossless_defs"}
    source = (SCRIPTS / "train_lossless.py").read_text().split("\nX, Y = data()")[0]
    exec(compile(source.replace("import ringtrain.torch as hvd", "").replace("hvd.init()", ""),
                 "train_lossless.py", "exec"), namespace)
    x, y = namespace["data"]()
    model = namespace["make_model"]()
    opt = namespace["make_optimizer"](model.parameters(), optimizer_name)
    for size, shards in history:
        assert len(shards) == size
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for indices in shards:
            model.zero_grad()
            namespace["loss_on"](model, x, y, indices).backward()
            grads = [g + p.grad for g, p in zip(grads, model.parameters())]
        for p, g in zip(model.parameters(), grads):
            p.grad = g / size
        opt.step()
    states = [{k: (v.tolist() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()}
              for p in model.parameters()]
    return [p.tolist() for p in model.parameters()], states


def check_against_replay(job, optimizer_name):
    final = job.lines("FINAL")
    assert len({lines[0]["digest"] for lines in final.values()}) == 1, f"the ranks' final states differ\n{job}"
    [line] = re.findall(r"^rank 0: REFERENCE (.*)$", job.output, re.M)
    final = json.loads(line)
    history = final["history"]
    trained = sorted(i for _, shards in history for shard in shards for i in shard)
    assert trained == list(range(48)), f"each sample once: {trained}\n{job}"
    params, states = replay(history, optimizer_name)
    for got, want in zip(final["params"], params):
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
    assert [sorted(s) for s in final["optimizer"]] == [sorted(s) for s in states], job
    for got, want in zip(final["optimizer"], states):
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-9, atol=1e-12, err_msg=key)
    return history


def test_lossless_kill_at_a_random_moment_equals_the_replay_of_what_was_trained(tmp_path):
    """3 workers, SGD with momentum or Adam (drawn), no commit(): a killed worker costs at most the step in flight (the first
    world's completed steps are all in the final trajectory), the samples no completed step consumed are dealt
    again (reported), and a worker that joins afterwards (the host's cooldown over) takes the whole state:
    parameters, optimizer state and steps. The discovery script fails once and prints garbage once meanwhile."""
    workers = 3
    # in the first half of the epoch: the smaller world then has steps enough to agree on the joiner (the news
    # reaches the ranks at a step, its check is read a step later, the interrupt is raised at the next step)
    seed, rank, step, point, optimizer = draw(workers, last_step=4)
    print(f"draw: RINGTRAIN_TEST_SEED={seed}: rank {rank} killed in step {step} at {point}; {optimizer}")
    # the discovery script fails on its 3rd call and prints garbage on its 4th: the driver keeps the last host list
    calls = tmp_path / "calls"
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\necho x >> {calls}\nn=$(wc -l < {calls})\n"
                      f"if [ $n -eq 3 ]; then echo boom >&2; exit 3; fi\n"
                      f"if [ $n -eq 4 ]; then echo 'not a host line'; exit 0; fi\n"
                      f"echo localhost:{workers}\n")
    script.chmod(0o755)
    job = run_elastic("-np", str(workers), "--min-np", str(workers - 1), "--max-np", str(workers),
                      "--host-discovery-script", str(script), "--blacklist-cooldown-range", "1", "1",
                      script="train_lossless.py", OPTIMIZER=optimizer, KILL_RANK=rank, KILL_STEP=step,
                      KILL_AT=point, JOIN=1)
    assert job.returncode == 0, job
    assert f"rank {rank}: KILLED" in job.output, job
    assert f"world 2: {workers - 1} workers" in job.output, job
    assert re.search(rf"world 3: {workers} workers; joined: localhost\[{rank}\]", job.output), job
    assert re.search(r"discover\.sh' exited with code 3: boom; keeping the last host list", job.output), job
    assert re.search(r"'not a host line' is not 'hostname' or 'hostname:slots'; keeping the last host list",
                     job.output), job
    history = check_against_replay(job, optimizer)
    check_lossless(job, history, workers, step, point, redealt_in=workers - 1)


@pytest.mark.parametrize("shard, workers", [("optimizer", 3), ("gradients", 4)])
def test_lossless_sharded_optimizer_loses_no_state_when_a_worker_dies(tmp_path, shard, workers):
    """A sharded optimizer: no rank holds the whole optimizer state, each rank's shard is also kept (and updated
    every step) on its ring neighbour. A worker SIGKILLed at a random moment loses no state: the survivors rebuild
    their new shards from the shards and the copies, and the final parameters and optimizer state (consolidated)
    equal the replay. At 3 workers a worker joins afterwards and takes its shard too. At 4, another worker (not the
    first one's neighbour) dies while the next world forms -- drawn: before the formation barrier (as the plan
    reaches it), or past it inside MPI (as a joiner told to connect while the others are inside MPI's Accept for it,
    which times out; as the world's rank 0 inside its Accept, its joiner told to connect a second later): the world
    is abandoned and planned again without it, and the 2 survivors rebuild the 4 shards.
    RINGTRAIN_TEST_FORM_KILL_AT=plan|mpi fixes that draw."""
    seed, rank, step, point, optimizer = draw(workers, last_step=4 if workers == 3 else None)
    print(f"draw: RINGTRAIN_TEST_SEED={seed}: rank {rank} killed in step {step} at {point}; {optimizer}")
    args = ["-np", str(workers), "--min-np", str(2), "--max-np", str(workers)]
    form_kill_at = os.environ.get("RINGTRAIN_TEST_FORM_KILL_AT", random.Random(f"form {seed}").choice(("plan", "mpi")))
    env = {}
    if workers == 4:
        print(f"rank {(rank + 2) % workers} dies while world 2 forms: {form_kill_at}")
        env.update(FORM_KILL=(rank + 2) % workers, FORM_KILL_AT=form_kill_at, RINGTRAIN_ELASTIC_CONNECT_TIMEOUT_S=3)
    if workers == 3:
        script = tmp_path / "discover.sh"
        script.write_text(f"#!/bin/sh\necho localhost:{workers}\n")
        script.chmod(0o755)
        args += ["--host-discovery-script", str(script), "--blacklist-cooldown-range", "1", "1"]
        env["JOIN"] = 1
    job = run_elastic(*args, script="train_lossless.py", OPTIMIZER=optimizer, SHARD=shard, KILL_RANK=rank,
                      KILL_STEP=step, KILL_AT=point, **env)
    assert job.returncode == 0, job
    assert f"rank {rank}: KILLED at" in job.output and f"world 2: {workers - 1} workers" in job.output, job
    if workers == 3:
        assert re.search(rf"world 3: {workers} workers; joined: localhost\[{rank}\]", job.output), job
    else:
        victim = (rank + 2) % workers
        if form_kill_at == "plan":
            assert f"rank {victim}: KILLED while world 2 formed" in job.output, job
        else:
            assert f"rank {victim}: KILLED inside the formation of world 2" in job.output, job
        when = "before" if form_kill_at == "plan" else "while"
        assert re.search(rf"world 2 abandoned: worker localhost\[{victim}\] .* {when} it formed .*; planning again "
                         rf"with the 2 others", job.output), job
        assert "world 3: 2 workers" in job.output and "world 4" not in job.output, job
        assert "still inside MPI" not in job.output, job          # no survivor was stuck there
    history = check_against_replay(job, optimizer)
    check_lossless(job, history, workers, step, point, redealt_in=2)


def test_lossless_two_deaths_at_once_then_one_during_the_sync(tmp_path):
    """4 workers, SGD with momentum or Adam (drawn), no commit(): two workers SIGKILLed at the same random moment of a random step, then, in
    the world of the 2 survivors, one of them dies half way through the sync (after the parameters were handed
    over, before the optimizer state): the last one goes on from a whole state and ends equal to the replay."""
    workers = 4
    seed, rank, step, point, optimizer = draw(workers)
    pair = (rank, (rank + 1) % workers)
    print(f"draw: RINGTRAIN_TEST_SEED={seed}: ranks {pair} killed in step {step} at {point}; {optimizer}")
    job = run_elastic("-np", str(workers), "--min-np", "1", script="train_lossless.py", OPTIMIZER=optimizer,
                      KILL_RANK=f"{pair[0]},{pair[1]}", KILL_STEP=step, KILL_AT=point, SYNC_KILL=1)
    assert job.returncode == 0, job
    assert all(f"rank {r}: KILLED at" in job.output for r in pair), job
    assert "world 2: 2 workers" in job.output and "world 3: 1 workers" in job.output, job
    assert re.search(r"^rank \d: KILLED in sync", job.output, re.M), job
    history = check_against_replay(job, optimizer)
    check_lossless(job, history, workers, step, point, redealt_in=1)


def check_lossless(job, history, workers, step, point, redealt_in):
    """No completed step lost; the samples dealt again (reported by the first world of size `redealt_in` to
    start training) at most one step's worth."""
    first_world_steps = next(i for i, (size, _) in enumerate(history) if size != workers)
    assert first_world_steps >= step, f"steps before the one in flight were lost: {first_world_steps} < {step}"
    counts = _redealt(job, redealt_in)
    assert len(set(counts)) == 1, job                                   # every rank of that world saw the same
    count = counts[0]
    print(f"re-dealt samples: {count} (first world completed {first_world_steps} steps; killed in step {step})")
    assert count <= workers * 2, job                                    # at most the step in flight
    if point == "before":
        assert first_world_steps == step and count == workers * 2, job  # that step completed nowhere


def _redealt(job, size):
    """The re-dealt counts the ranks of the first world of `size` reported as it started."""
    return [int(n) for n in re.findall(rf"^rank \d+: REDEALT (\d+) steps=\d+ size={size}$", job.output, re.M)][:size]


def test_rollback_mode_with_commits_equals_the_replay_of_the_committed_steps():
    """Horovod's mode, chosen explicitly: a commit every 2 steps, a kill after an uncommitted step; the survivors
    roll back to the commit and the final state equals the replay of the committed trajectory. Each worker picks
    its GPU by its slot (checked with a pretend device count of 2)."""
    job = run_elastic("-np", "3", "--min-np", "2", script="train_lossless.py", OPTIMIZER="adam", ROLLBACK=1,
                      COMMIT_EVERY=2, KILL_RANK=1, KILL_STEP=3, KILL_AT="before")
    assert job.returncode == 0, job
    assert "rank 1: KILLED" in job.output and "world 2: 2 workers" in job.output, job
    first_world = {int(r): (int(s), int(d)) for r, s, d in
                   re.findall(r"^rank (\d+): GPU slot=(\d+) device_of_2=(\d+)$", job.output, re.M)[:3]}
    assert sorted(first_world) == [0, 1, 2], job
    assert sorted(s for s, _ in first_world.values()) == [0, 1, 2], job           # one slot each on localhost
    assert all(d == s % 2 for s, d in first_world.values()), job                  # GPU = slot % device count
    history = check_against_replay(job, "adam")
    assert sum(1 for size, _ in history if size == 3) == 2, job        # step 2 (uncommitted) was rolled back
    assert _redealt(job, 2) == [2 * 3 * 2] * 2, job                    # steps 2 and 3 dealt again


def test_scale_down_at_a_step_boundary_then_a_survivor_stuck_after_a_death_is_lost_not_the_job(tmp_path):
    """4 workers. The discovery script drops a slot mid-run: its worker leaves at the next step boundary (exit 0,
    saying why), the others go on without a roll-back or a sync. Then, in that world of 3, rank 1 is SIGKILLed as a
    step begins and rank 2, told of it, hangs in a blocking C call (as in a hung MPI_Abort: MPICH's ofi aborts a
    survivor whose probe meets the dead peer's endpoint). Its leave watchdog ends it after
    RINGTRAIN_ELASTIC_LEAVE_TIMEOUT_S, the driver counts one more death (not its own leave backstop), and rank 0
    goes on alone. The final state equals the replay."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:4\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(0o755)
    job = run_elastic("-np", "4", "--min-np", "1", "--host-discovery-script", str(script), script="train_lossless.py",
                      OPTIMIZER="sgd", SHRINK_HOSTS_FILE=hosts, SHRINK_STEP=2, KILL_WORLD=2, KILL_RANK=1, KILL_STEP=1,
                      KILL_AT="before", HANG_RANK=2, RINGTRAIN_ELASTIC_LEAVE_TIMEOUT_S=2)
    assert job.returncode == 0, job
    # the scale-down
    assert "localhost[3] leave world 1 at its next step boundary" in job.output, job
    assert re.search(r"world 2: 3 workers; left: localhost\[3\]", job.output), job
    assert re.search(r"worker localhost\[3\]#\d+ leaves the job: its slot localhost\[3\] is no longer in the host "
                     r"list", job.output), job
    assert "KILLED" not in job.output.split("world 2: 3 workers")[0], job
    dead = re.findall(r"^ringtrain-run: worker (localhost\[\d\])[^;\n]* (?:lost its connection|exited with code|was "
                      r"killed)", job.output, re.M)
    assert sorted(dead) == ["localhost[1]", "localhost[2]"], job      # the leaving worker is no death
    assert _redealt(job, 3) == [8, 8, 8], job                           # the step that raised the interrupt
    # the stuck survivor
    assert "rank 1: KILLED" in job.output and "rank 2: HANGING" in job.output, job
    assert re.search(r"ringtrain: worker localhost\[2\]#\d+ could not leave world 2 within 2 s "
                     r"\(RINGTRAIN_ELASTIC_LEAVE_TIMEOUT_S\) of a death in it", job.output), job
    assert "in hang_here" in job.output, job                           # where its main thread was
    assert re.search(r"worker localhost\[2\] \(rank 2 of world 2\) (lost its connection|exited with code 1)",
                     job.output), job
    assert "world 3: 1 workers" in job.output and "did not leave" not in job.output, job
    history = check_against_replay(job, "sgd")
    left = 48 - sum(len(shard) for size, shards in history if size > 1 for shard in shards)
    assert left > 0 and _redealt(job, 1) == [min(6, left)], job           # the step the death cut, whole
    sizes = [size for size, _ in history]
    first_world_steps = sizes.index(3)
    assert first_world_steps >= 3, job                                  # steps 0-2 kept: nothing rolled back
    assert sizes == [4] * first_world_steps + [3] + [1] * (len(sizes) - first_world_steps - 1), job


def test_a_discovery_script_failing_at_the_start_ends_the_job_naming_it(tmp_path):
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho 'no inventory' >&2\nexit 2\n")
    script.chmod(0o755)
    job = run_elastic("-np", "2", "--min-np", "2", "--host-discovery-script", str(script), script="train_lossless.py")
    assert job.returncode != 0, job
    assert re.search(r"elastic job failed: host discovery script '.*discover\.sh' exited with code 2: no inventory; "
                     r"no host list to start the job with", job.output), job
    assert "world 1" not in job.output and job.seconds < 30, job


def test_when_the_driver_dies_every_worker_ends_with_a_clear_error(tmp_path):
    """SIGKILL the launcher mid-training: no worker is left running (each sees its driver connection close, its
    waits end, and it leaves naming the driver), within seconds."""
    import signal
    import subprocess
    import sys
    import time

    from elastic_jobs import REPO
    worker_script = tmp_path / "orphan_check_job.py"         # a unique path to find the workers by
    worker_script.write_text((SCRIPTS / "train_lossless.py").read_text())
    environ = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", STEP_SLEEP="0.5",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")])))
    out_path = tmp_path / "out"
    with open(out_path, "w") as out:
        launcher = subprocess.Popen([sys.executable, "-m", "ringtrain.launch.run", "-np", "2", "--min-np", "2",
                                     sys.executable, str(worker_script)], cwd=REPO, env=environ, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
    def workers():
        return workers_running(worker_script)

    deadline = time.monotonic() + 90
    try:
        while "REDEALT 0" not in out_path.read_text():
            assert time.monotonic() < deadline and launcher.poll() is None, out_path.read_text()
            time.sleep(0.1)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        end = time.monotonic() + 30
        while workers():
            assert time.monotonic() < end, f"workers still running 30 s after the driver died:\n{out_path.read_text()}"
            time.sleep(0.2)
    finally:
        for pid in workers():                       # this test's own workers, by id
            os.kill(pid, signal.SIGKILL)
    print(out_path.read_text())


def workers_running(path):
    import subprocess
    found = subprocess.run(["pgrep", "-f", str(path)], capture_output=True, text=True).stdout.split()
    return [int(pid) for pid in found]
