"""The elastic pieces that need no processes: the sampler across resizes, ObjectState, host lists, the blacklist."""
import os
import random
import stat
from unittest import mock

import pytest

from ringtrain.elastic import sampler as sampler_module
from ringtrain.elastic.sampler import ElasticSampler
from ringtrain.elastic import lossless
from ringtrain.elastic.state import ObjectState
from ringtrain.errors import ElasticError, HostsUpdatedInterrupt
from ringtrain.launch.hosts import Blacklist, DiscoveryError, free_slots, parse_hosts, run_discovery


class World:
    """Stands in for the process-wide state the sampler reads: rank `rank` of `size`."""

    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def is_initialized(self):
        return True

    def rank(self):
        return self._rank

    def size(self):
        return self._size


def deal(sampler, rank, size):
    """The sampler as rank `rank` of `size` sees it: its own reset() reads that world."""
    with mock.patch.object(sampler_module, "core_state", World(rank, size)):
        sampler.reset()
    return sampler


def new_world(samplers, size):
    """What sync() does after a resize: rank 0's record loaded (load_state_dict re-deals) on each rank of the new
    world."""
    record = samplers[0].state_dict()
    fresh = []
    for rank in range(size):
        s = ElasticSampler(range(len(samplers[0].dataset)), shuffle=True, seed=3)
        with mock.patch.object(sampler_module, "core_state", World(rank, size)):
            s.load_state_dict(record)
        fresh.append(s)
    return fresh


@pytest.mark.parametrize("sizes", [(3, 2), (2, 4, 1), (4, 3, 2, 3)])
def test_sampler_trains_every_sample_once_across_resizes_and_lost_ranks(sizes):
    """Each world runs a few lockstep steps, then its last rank dies (its own record is lost) and the survivors
    resize. The samples trained by committed steps, over all worlds, are every sample exactly once."""
    n, batch = 53, 4
    samplers = new_world([ElasticSampler(range(n), shuffle=True, seed=3)], sizes[0])
    trained = []
    rng = random.Random(1)
    for world, size in enumerate(sizes):
        last = world == len(sizes) - 1
        steps = samplers[0].steps(batch)
        assert {s.steps(batch) for s in samplers} == {steps}               # every rank agrees on the count
        for b in range(steps if last else rng.randint(0, max(0, steps - 1))):
            for s in samplers:
                trained += s.get_indices(b, batch)
            for s in samplers:
                s.record_batch(b, batch)
        if not last:
            survivors = samplers[:-1] or samplers
            samplers = new_world(survivors, sizes[world + 1])
    assert sorted(trained) == list(range(n))


def test_sampler_shards_never_pad_and_differ_by_at_most_one():
    s = ElasticSampler(range(10), shuffle=False)
    shards = [deal(s, r, 4).indices for r in range(4)]
    assert sorted(i for shard in shards for i in shard) == list(range(10))
    assert {len(x) for x in shards} == {2, 3}
    s.set_epoch(1)
    assert s.processed_indices == set() and s.epoch == 1


def test_object_state_commit_restore_keeps_copies():
    state = ObjectState(epoch=0, history=[1])
    state.rollback = True              # Horovod's mode (hvd.elastic.run(rollback=True) sets it)
    state.history.append(2)
    state.epoch = 3
    state.commit()                     # no elastic job: commit is a save, no collective
    state.history.append(99)
    state.epoch = 4
    state.restore()
    assert (state.epoch, state.history) == (3, [1, 2])
    state.history.append(5)           # the restored value is a copy, not the committed object itself
    state.restore()
    assert state.history == [1, 2]


def test_hosts_and_blacklist():
    assert parse_hosts("a:2,b", default_slots=3) == {"a": 2, "b": 3}
    assert parse_hosts("a:2\n# comment\nb:1\n") == {"a": 2, "b": 1}
    with pytest.raises(DiscoveryError, match="'a:x'"):
        parse_hosts("a:x")
    forever = Blacklist()
    forever.record_failure("a", now=0.0)
    assert forever.blocked("a", now=1e9) and not forever.blocked("b", now=0.0)
    cooling = Blacklist((2.0, 5.0), rng=random.Random(0))
    first = cooling.record_failure("a", now=0.0)
    assert 2.0 <= first <= 2.2 and cooling.blocked("a", 1.9) and not cooling.blocked("a", 2.3)
    assert 4.0 <= cooling.record_failure("a", now=10.0) <= 4.4          # doubles with each failure ...
    assert 5.0 <= cooling.record_failure("a", now=20.0) <= 5.5          # ... up to the range's top
    assert free_slots({"a": 2, "b": 1}, {("b", 0)}, cooling, now=20.0) == []
    assert free_slots({"a": 2, "b": 2}, {("b", 0)}, cooling, now=30.0) == [("a", 0), ("a", 1), ("b", 1)]


def script(tmp_path, body):
    path = tmp_path / "discover.sh"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_discovery_reads_hosts_and_names_every_failure(tmp_path):
    """A discovery script that fails never reads as "no hosts": a non-zero exit, a timeout, a missing script and
    garbage each raise DiscoveryError naming the script and what went wrong."""
    assert run_discovery(script(tmp_path, "echo a:2; echo b"), default_slots=3) == {"a": 2, "b": 3}
    with pytest.raises(DiscoveryError, match=r"exited with code 3: boom"):
        run_discovery(script(tmp_path, "echo a:2; echo boom >&2; exit 3"), default_slots=1)
    with pytest.raises(DiscoveryError, match=r"discover\.sh.*failed: .*timed out"):
        run_discovery(script(tmp_path, "sleep 5"), default_slots=1, timeout_s=0.3)
    with pytest.raises(DiscoveryError, match=r"is not 'hostname' or 'hostname:slots'"):
        run_discovery(script(tmp_path, "echo 'a b c'"), default_slots=1)
    with pytest.raises(DiscoveryError, match="failed"):
        run_discovery(os.path.join(str(tmp_path), "missing.sh"), default_slots=1)
    with pytest.raises(DiscoveryError, match=r"discover\.sh' printed no host"):
        run_discovery(script(tmp_path, "echo '# nothing up'"), default_slots=1)


def test_the_driver_protocol_reassembles_messages_split_anywhere():
    """TCP delivers bytes, not lines: a message split across reads, or several in one read, decode whole."""
    from ringtrain.world.elastic_protocol import LineReader, encode
    stream = encode("hello", worker="w1", pid=7) + encode("ready") + encode("port", port="tag#0$port=5$")
    for cut in range(1, len(stream)):
        reader = LineReader()
        got = reader.feed(stream[:cut]) + reader.feed(stream[cut:])
        assert got == [{"op": "hello", "worker": "w1", "pid": 7}, {"op": "ready"},
                       {"op": "port", "port": "tag#0$port=5$"}], cut


def test_an_elastic_worker_binds_the_gpu_of_its_slot_whatever_its_local_rank():
    from ringtrain import gpu
    from ringtrain.core import state as core_state
    from ringtrain.world import elastic_worker
    elastic = {"RINGTRAIN_ELASTIC_DRIVER": "127.0.0.1:9", "RINGTRAIN_ELASTIC_SLOT": "3"}
    assert elastic_worker.slot(elastic) == 3
    assert elastic_worker.slot({"RINGTRAIN_ELASTIC_SLOT": "3"}) is None          # not an elastic worker
    assert elastic_worker.slot({"RINGTRAIN_ELASTIC_DRIVER": "127.0.0.1:9"}) is None
    with mock.patch.dict(os.environ, elastic):
        assert core_state.gpu_index(local_rank=0) == 3
        assert [gpu.choose_device(core_state.gpu_index(0), n) for n in (1, 2, 4, 8)] == [0, 1, 3, 3]
    with mock.patch.dict(os.environ, {}, clear=True):
        assert core_state.gpu_index(local_rank=5) == 5 and gpu.choose_device(5, 4) == 1


def test_lossless_sync_takes_the_lowest_rank_that_completed_the_most_steps():
    def gathered(values):
        return mock.patch.object(lossless.collectives, "allgather_object", lambda value, name=None: values)
    with gathered([4, 5, 5, 3]):
        assert lossless.source_rank(4) == (1, [4, 5, 5, 3])
    with gathered([0, 0]):                                  # the first world: rank 0, as Horovod
        assert lossless.source_rank(0)[0] == 0
    with gathered([-1, 2, -1]):                             # a half-overwritten state is never a source
        assert lossless.source_rank(-1)[0] == 1
    with gathered([-1, -1]), pytest.raises(ElasticError, match="no worker holds a whole training state"):
        lossless.source_rank(-1)


def test_lossless_host_check_acts_once_per_notice_and_holds_it_for_the_boundary():
    check = lossless.HostCheck()
    check.decide([-1, 0, 0])                                 # nobody heard anything
    check.boundary()
    check.decide([3, 1, 0])                                  # a worker is ready to join: sync follows
    with pytest.raises(HostsUpdatedInterrupt) as raised:
        check.boundary()
    assert raised.value.skip_sync is False
    check.boundary()                                         # raised once
    check.decide([3, 1, 0])                                  # the same notice again (heard late): no news
    check.boundary()
    check.decide([4, 0, 1])                                  # only removed: every rank holds the same state
    with pytest.raises(HostsUpdatedInterrupt) as raised:
        check.boundary()
    assert raised.value.skip_sync is True


def _driver_with_world(size, boundaries):
    """An ElasticDriver whose world is `size` fake workers, each wired to a StepBoundary as its reader thread
    would be: the driver's hosts_updated/stop_at reach the boundary, its at_step reaches the driver."""
    import types

    from ringtrain.launch.elastic_driver import ElasticDriver
    from ringtrain.launch.elastic_workers import Worker
    from ringtrain.world.elastic_boundary import StepBoundary
    driver = ElasticDriver(["true"], {}, "mpiexec", size)
    process = types.SimpleNamespace(poll=lambda: None)
    driver.world = [Worker(f"localhost[{r}]#{r}", "localhost", r, process, 0.0) for r in range(size + 1)]
    newcomer = driver.world.pop()
    driver.workers = driver.world + [newcomer]
    driver.generation = 1
    for rank, worker in enumerate(driver.world):
        worker.rank, worker.generation = rank, 1

        def send(op, worker=worker, **fields):
            driver._on_message(worker, dict(op=op, **fields))
        boundaries.append(StepBoundary(send, worker.id, timeout_s=5))
        boundaries[-1].new_world(1)

    def deliver(worker, op, **fields):
        boundary = boundaries[worker.rank]
        if op == "hosts_updated":
            boundary.heard(fields["seq"], fields["generation"])
        elif op == "stop_at":
            boundary.answer(fields["generation"], fields["steps"], fields["seq"], fields["added"], fields["removed"])
    driver._send = deliver
    return driver, newcomer


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_driver_picks_one_stop_step_for_every_rank_without_a_collective(seed):
    """3 ranks step in lockstep (a barrier stands for each step's collective, so they differ by at most one
    step); the driver announces a newcomer at a random moment and answers a random while later. Every rank gets the
    decision after the same step, max(reported) + 1, none passes it, and nobody waits forever."""
    import threading
    import time
    rng = random.Random(seed)
    boundaries = []
    driver, newcomer = _driver_with_world(3, boundaries)
    collective = threading.Barrier(3, timeout=10)
    decided = {}

    def rank(r):
        for _ in range(60):
            collective.wait()
            time.sleep(rng.uniform(0, 0.002))
            decision = boundaries[r].step_done()
            if decision is not None:
                decided[r] = (boundaries[r].steps, decision)
                return
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    try:
        for t in threads:
            t.start()
        time.sleep(rng.uniform(0.005, 0.03))
        driver._announce(newcomer)                          # hosts_updated: every rank reports at once
        reports = dict(driver.news["reports"])
        assert len(reports) == 3 and max(reports.values()) - min(reports.values()) <= 1
        time.sleep(rng.uniform(0, 0.03))                     # ranks that reached report + 1 wait here
        assert all(b.steps <= reports[w] + 1 for b, w in zip(boundaries, driver.world))
        driver._answer_news()
        for t in threads:
            t.join(10)
        stop = max(reports.values()) + 1
        assert decided == {r: (stop, (driver.news["seq"], True, False)) for r in range(3)}
        driver._tell_world(added=False, removed=True)       # later news waits for the next world
        assert driver.news["added"] and driver.news["answered"]
    finally:
        driver.channel.close()


def test_a_world_stopped_for_removed_workers_only_takes_in_no_newcomer():
    """Its members skip the sync (HostsUpdatedInterrupt(skip_sync=True)): a newcomer that became ready after the
    news waits for the next world, where it is announced; one stopped for added workers takes it in."""
    for added, joins in ((False, False), (True, True)):
        driver, newcomer = _driver_with_world(2, [])
        try:
            driver._tell_world(added=added, removed=not added)
            for worker in driver.workers:
                worker.ready_at = 1.0
            planned = []
            driver._form = lambda members, now: planned.extend(members)
            driver._maybe_form(2.0)
            assert (newcomer in planned) is joins and planned[:2] == driver.world
        finally:
            driver.channel.close()


def test_a_step_boundary_wait_ends_when_the_world_fails_and_old_news_is_ignored():
    from ringtrain.world.elastic_boundary import StepBoundary
    import threading
    sent = []
    boundary = StepBoundary(lambda op, **fields: sent.append((op, fields)), "w#1", timeout_s=5)
    boundary.heard(1, 2)                                     # about world 2, still forming here: 0 steps
    boundary.new_world(2)
    assert sent == [("at_step", {"seq": 1, "generation": 2, "steps": 0})]
    boundary.heard(0, 1)                                     # about world 1, already left: no report
    assert len(sent) == 1
    done = []
    waiter = threading.Thread(target=lambda: done.append(boundary.step_done()))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()                                 # step 1 waits for the driver's answer
    boundary.broken(2)                                       # a death in world 2
    waiter.join(5)
    assert done == [None]
    quick = StepBoundary(lambda op, **fields: None, "w#2", timeout_s=0.1)
    quick.new_world(1)
    quick.heard(3, 1)
    with pytest.raises(ElasticError, match=r"w#2: the elastic driver did not say within 0.1 s at which step world 1"):
        quick.step_done()


def test_elastic_workers_never_get_libfabrics_sockets_provider():
    """A user's FI_PROVIDER naming sockets is replaced by tcp for the workers, with a line saying why; other
    choices (and an exclusion of sockets) are left alone; unset gets tcp."""
    from ringtrain.launch.elastic_workers import WorkerProcesses
    for given, kept in (("sockets", False), ("tcp;ofi_rxm,sockets", False), ("^sockets", True), ("verbs", True),
                        (None, True)):
        env = {} if given is None else {"FI_PROVIDER": given}
        processes = WorkerProcesses(["true"], env, "mpiexec", 1)
        assert (processes.notice is None) is kept, given
        if not kept:
            assert processes.env["FI_PROVIDER"] == "tcp", given
            assert f"FI_PROVIDER={given} is replaced by FI_PROVIDER=tcp" in processes.notice
        else:
            assert processes.env.get("FI_PROVIDER") == given
    launched = []
    with mock.patch("subprocess.Popen", lambda cmd, env, **kw: launched.append(env)):
        WorkerProcesses(["true"], {"FI_PROVIDER": "sockets"}, "mpiexec", 1).start("localhost", 0, 0.0)
        WorkerProcesses(["true"], {}, "mpiexec", 1).start("localhost", 0, 0.0)
    assert [env["FI_PROVIDER"] for env in launched] == ["tcp", "tcp"]


def test_torch_state_counts_each_optimizer_step_once():
    """The lossless source is chosen by steps completed: one per step(), also after load_state_dict (which makes
    torch's own step hooks run twice per step on a DistributedOptimizer)."""
    torch = pytest.importorskip("torch")
    from ringtrain.torch.elastic_state import TorchState
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = TorchState(model, optimizer, epoch=0)
    for _ in range(2):
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()
    optimizer.load_state_dict(optimizer.state_dict())
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    assert state.steps_completed() == state.progress() == 3


def test_a_broken_sync_leaves_no_source_behind():
    """A receiver whose sync broke half way (its source died) holds a half-overwritten state: it reports progress
    -1, so the next sync never takes it; a rank as far as the source lost nothing and stays a source."""
    from ringtrain.elastic import state as state_module
    from ringtrain.errors import RankFailureError

    class Breaking(ObjectState):
        def steps_completed(self):
            return 5

        def sync_from(self, root):
            raise RankFailureError("the source died")

    for everyone, me, expected in (([7, 5], 1, -1), ([5, 5], 1, 5)):
        state = Breaking(epoch=0)
        with mock.patch.object(state_module, "source_rank", lambda progress: (0, everyone)), \
                mock.patch.object(state_module, "core_state", mock.Mock(is_initialized=lambda: True,
                                                                         rank=lambda: me)):
            with pytest.raises(RankFailureError):
                state.sync()
        assert state.progress() == expected


def test_lossless_sync_hands_over_from_the_furthest_rank_and_rollback_from_rank_0():
    from ringtrain.elastic import state as state_module

    class Recording(ObjectState):
        def sync_from(self, root):
            self.roots.append(root)

    for rollback, expected in ((False, [2]), (True, [0])):
        state = Recording(epoch=0)
        state.roots, state.rollback = [], rollback
        with mock.patch.object(state_module, "source_rank", lambda progress: (2, [3, 3, 4])), \
                mock.patch.object(state_module, "core_state", mock.Mock(is_initialized=lambda: True,
                                                                         rank=lambda: 0)):
            state.sync()
        assert state.roots == expected
        assert state.progress() == 0                    # handed over whole: a source again


def test_the_driver_channel_hands_over_what_came_with_the_hello_and_sees_a_close():
    import socket
    import types

    from ringtrain.launch.elastic_channel import DriverChannel
    from ringtrain.world.elastic_protocol import encode
    channel = DriverChannel()
    worker = types.SimpleNamespace(id="localhost[0]#1", gone=False, conn=None, reader=None)
    stranger = socket.create_connection(("127.0.0.1", channel.port))
    stranger.sendall(encode("hello", worker="nobody", pid=1))
    client = socket.create_connection(("127.0.0.1", channel.port))
    client.sendall(encode("hello", worker=worker.id, pid=2) + encode("ready"))     # one segment
    events = []
    for _ in range(50):
        events += channel.poll(0.05, [worker])
        if events:
            break
    assert events == [(worker, {"op": "ready"})]
    assert stranger.recv(10) == b""                          # a hello naming no live worker is closed
    assert channel.send(worker, "world", rank=0, size=1, generation=1)
    assert client.recv(200).startswith(b'{"op": "world"')
    client.close()
    closed = []
    for _ in range(50):
        closed += channel.poll(0.05, [worker])
        if closed:
            break
    assert closed == [(worker, None)]
    channel.drop(worker)
    assert not channel.send(worker, "world")                 # dropped: unreachable, no exception
    channel.close()


def test_a_sharded_optimizers_old_shards_are_cut_into_a_new_worlds_shards():
    """What a new world's ranks assemble from the old world's pieces (its owners' or their neighbours' copies):
    every new piece's elementwise state equals the slice of the whole, at any old and new number of ranks; the
    per-parameter scalars (the step) come along."""
    import torch

    from ringtrain.reducer.sharding import ShardPlan
    from ringtrain.torch.elastic_shards import _cut, _Part
    numels, buckets = [6, 2, 5], [[0, 1], [2]]
    whole = [torch.arange(n, dtype=torch.float64) + 10 * i for i, n in enumerate(numels)]
    for old_size, new_size in ((3, 2), (2, 4), (4, 1)):
        parts = {i: [] for i in range(len(numels))}
        for r in range(old_size):
            for piece in ShardPlan(numels, buckets, old_size).pieces(r):
                chunk = whole[piece.param][piece.start:piece.start + piece.length]
                parts[piece.param].append(_Part(piece.start, piece.length, {
                    "step": torch.tensor(7.0), "exp_avg": chunk.clone(), "exp_avg_sq": chunk * 2}))
        for r in range(new_size):
            pieces = ShardPlan(numels, buckets, new_size).pieces(r)
            for piece, entry in zip(pieces, _cut(pieces, parts)):
                want = whole[piece.param][piece.start:piece.start + piece.length]
                assert torch.equal(entry["exp_avg"], want) and torch.equal(entry["exp_avg_sq"], want * 2)
                assert float(entry["step"]) == 7.0


def test_a_shard_whose_owner_and_neighbour_both_died_ends_the_job_naming_it():
    """Old world of 4: the survivors were ranks 2 and 3 (holding shards 1, 2 and 2, 3): shard 0's owner and the
    neighbour that kept its copy (rank 1) are both gone, so no state can be rebuilt: ElasticError on every rank."""
    from types import SimpleNamespace

    from ringtrain.torch import elastic_shards
    backup = object.__new__(elastic_shards.ShardBackup)
    backup.optimizer = SimpleNamespace(_ringtrain=SimpleNamespace(prefix="ShardedOptimizer0", process_set=None))
    backup.held = {"size": 4, "plan": None, "rank": 2, "updates": 5, "shards": {1: [], 2: []}}
    infos = [{"steps": 5, "size": 4, "plan": None, "rank": 2, "updates": 5, "holds": [1, 2]},
             {"steps": 5, "size": 4, "plan": None, "rank": 3, "updates": 5, "holds": [2, 3]}]
    with mock.patch.object(elastic_shards.functions, "allgather_object", return_value=infos):
        with pytest.raises(ElasticError, match=r"shard 0 .*world\) is lost.*rank 1 then"):
            backup.restore(0, 5)


def test_a_sharded_optimizer_counts_its_shard_updates_and_roll_back_mode_refuses_it():
    """One process (a world of one: no neighbour, no copy): the state counts the step and the shard update alike;
    roll-back mode, which copies whole optimizer states at commits, refuses a sharded optimizer by name."""
    torch = pytest.importorskip("torch")
    import ringtrain.torch as hvd
    hvd.init()
    try:
        model = torch.nn.Linear(2, 1)
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                             named_parameters=model.named_parameters(), shard="optimizer")
        state = hvd.elastic.TorchState(model, optimizer)
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()
        assert state.steps_completed() == state._handlers["optimizer"].backup.updates == 1
        state.rollback = True
        with pytest.raises(ValueError, match=r"roll-back mode .* sharded optimizer"):
            state.commit()
    finally:
        hvd.shutdown()
