"""The elastic driver inside `ringtrain-run`: forms the world from whoever is alive, and re-forms it when workers
die, join or leave.

    ringtrain-run -np 4 --min-np 2 --max-np 6 --host-discovery-script ./discover.sh python train.py
    ringtrain-run -np 3 --min-np 2 -H localhost:3 python train.py

Its parts: the host list (hosts.HostWatch: fixed, or the discovery script's), the worker processes
(elastic_workers.py: each worker is `mpiexec -n 1 [-hosts H] command` with the driver's address in its
environment), the messages (elastic_channel.py: one TCP connection per worker, ringtrain/world/elastic_protocol.py).
This class decides: who is in which world, and what a death, a new worker or a removed slot means.

A worker's connection closing (or its mpiexec ending) is how a death is seen, within milliseconds: the driver tells
the rest of that world at once (`peer_failed`, which ends their waits), blacklists the host, and forms the next world
when every survivor has asked for one. New workers (free slots, up to --max-np) are started as discovery offers
slots; once ready they are announced to the running world (`hosts_updated`), which stops at a step boundary (or a
commit) with HostsUpdatedInterrupt, and they join the next world. The driver picks that step: each member answers the
news with the steps it completed (`at_step`), and once all have, every member hears `stop_at` max + 1
(ringtrain/world/elastic_boundary.py) -- no collective per step. One such round per world: news that comes after it
waits for the next world (a newcomer is announced to it), and a world stopped for removed workers only (its
members skip the sync) takes in no newcomer. A slot that leaves the discovery script's list takes
its worker with it: outside the world at once, inside it at the world's next step boundary (`hosts_updated` with
removed=True; the next world is formed without it and it is told to `leave`, and exits 0).

The rules: the world's order is the old world's survivors by their old rank, then newcomers in the order they
became ready (so rank 0 is a survivor whenever there is one). Fewer than --min-np ready workers for
--elastic-timeout seconds ends the job with an error, as do more than --reset-limit re-formations, and a discovery
script that fails at the start (later failures keep the last host list). A worker dying while a world is being
formed (or a member's formation call failing) abandons that plan: the others ask again and the next plan goes
without the dead (a member stuck inside MPI exits after its connect timeout: one more death). A world with none of
the workers that held the training state (all died) ends the job. A survivor that has not left a failed world
within twice its leave timeout (RINGTRAIN_ELASTIC_LEAVE_TIMEOUT_S) is killed and counted as one more death. When one worker of the world exits 0 the job
is finishing: nothing new is formed or started, and the job's status is 0 when every worker of the last world exited
0.
"""
import os
import signal
import sys
import time

from ..world.elastic_protocol import leave_timeout_s
from .elastic_channel import DriverChannel
from .elastic_workers import WorkerProcesses, kill_group, signal_name
from .hosts import Blacklist, DiscoveryError, HostWatch, free_slots, parse_hosts

PROG = "ringtrain-run"
DISCOVERY_PERIOD_S = 1.0


class ElasticJobError(RuntimeError):
    pass


def _say(text):
    os.write(sys.stderr.fileno(), f"{PROG}: {text}\n".encode())     # one write: workers share this stream


class ElasticDriver:
    def __init__(self, command, env, mpiexec, num_ranks, min_np=None, max_np=None, hosts=None,
                 discovery_script=None, slots=1, reset_limit=None, elastic_timeout_s=600.0,
                 cooldown_range=None, formation_timeout_s=120.0):
        if not hosts and not discovery_script:
            hosts = f"localhost:{num_ranks}"
        self.num_ranks = num_ranks
        self.min_np = min_np if min_np is not None else num_ranks
        self.max_np = max_np
        self.hosts = HostWatch(parse_hosts(hosts, slots) if hosts else None, discovery_script, slots,
                               DISCOVERY_PERIOD_S)
        self.reset_limit = reset_limit
        self.elastic_timeout_s = elastic_timeout_s
        self.formation_timeout_s = formation_timeout_s
        # a worker's own leave watchdog ends it first (elastic_worker); this is for one whose Python cannot run
        self.leave_timeout_s = min(formation_timeout_s, 2 * leave_timeout_s() + 5)
        self.blacklist = Blacklist(cooldown_range)
        self.workers = []
        self.world = []                 # the current world's workers, by rank
        self.generation = 0
        self.resets = 0
        self.forming = None             # while a world is being formed: {"members", "next", "deadline", "port"}
        self.failed_at = None           # when a worker of the current world failed (its survivors must leave it)
        self.abandoned = None           # the last world abandoned while it formed
        self.finishing = False
        self.below_min_since = None
        self.update_seq = 0
        self.announced = set()          # newcomers already announced to the current world
        self.news = None                # the current world's round: {generation, seq, added, removed, reports, answered}
        self.channel = DriverChannel()
        self.processes = WorkerProcesses(command, env, mpiexec, self.channel.port)
        if self.processes.notice:
            _say(self.processes.notice)

    @property
    def available(self):
        return self.hosts.available

    # ------------------------------------------------------------------------------------------------ main loop
    def run(self):
        try:
            self._discover(time.monotonic(), required=True)
            while True:
                now = time.monotonic()
                self._discover(now)
                self._poll(0.02)
                self._reap()
                self._answer_news()
                if self.finishing:
                    if all(w.gone for w in self.workers):
                        return self._final_status()
                    continue
                self._advance_formation(now)
                self._start_workers(now)
                self._maybe_form(now)
        except ElasticJobError as error:
            _say(f"elastic job failed: {error}")
            return 1
        finally:
            self._stop_all()

    # ------------------------------------------------------------------------------------------------ hosts
    def _discover(self, now, required=False):
        try:
            found = self.hosts.poll(now)
        except DiscoveryError as error:
            if required:
                raise ElasticJobError(f"{error}; no host list to start the job with") from None
            _say(f"{error}; keeping the last host list")
            return
        if found is None:
            return
        if found != self.available:
            _say(f"hosts available: {', '.join(f'{h}:{s}' for h, s in found.items()) or 'none'}")
        self.hosts.available = found
        self._remove_outside(found)

    def _remove_outside(self, found):
        """Workers whose slot is no longer offered leave: those in the world at its next step boundary (the world
        hears hosts_updated with removed=True; the next world is formed without them and they are told to leave),
        the others at once."""
        outside = [w for w in self.workers if not w.gone and not w.removed and w.slot >= found.get(w.host, 0)]
        in_world = [w for w in outside if w in self.world and self.forming is None]
        for worker in outside:
            worker.removed = True
            if worker not in in_world:
                worker.status, worker.gone = "stopped: its host was removed", True
                self._drop_connection(worker)
                kill_group(worker.process, signal.SIGTERM)
        if in_world:
            _say(f"host slot(s) removed: {', '.join(w.label() for w in in_world)} leave world {self.generation} "
                 f"at its next step boundary")
            self._tell_world(added=False, removed=True)

    def _capacity(self):
        """How many workers the job wants alive now."""
        if self.generation == 0:
            return self.num_ranks
        return self.max_np if self.max_np is not None else 1 << 30

    # ------------------------------------------------------------------------------------------------ workers
    def _start_workers(self, now):
        if self.forming is not None:
            return
        alive = [w for w in self.workers if not w.gone]
        room = self._capacity() - len(alive)
        if room <= 0:
            return
        used = {(w.host, w.slot) for w in alive}
        for host, slot in free_slots(self.available, used, self.blacklist, now)[:room]:
            self._start(host, slot, now)

    def _start(self, host, slot, now):
        self.workers.append(self.processes.start(host, slot, now))

    def _poll(self, timeout):
        for worker, message in self.channel.poll(timeout, self.workers):
            if message is not None:
                self._on_message(worker, message)
            elif worker.exiting:            # a normal exit: its process status tells how it ended (_reap)
                self._drop_connection(worker)
            else:
                self._lost(worker, "lost its connection to the driver (died)")

    def _send(self, worker, op, **fields):
        if not self.channel.send(worker, op, **fields):
            self._lost(worker, "the driver could not reach it")

    def _on_message(self, worker, message):
        op = message["op"]
        if op == "exiting":
            worker.exiting = True
        elif op == "ready":
            worker.ready_at = time.monotonic()
            if (worker.generation is None and not worker.removed and self.world and self.forming is None
                    and not self.finishing):
                self._announce(worker)
        elif message.get("generation", self.generation) != self.generation:
            return                                  # about a world abandoned while it formed
        elif op == "planned" and self.forming is not None:
            self.forming["answered"].add(worker)
            if len(self.forming["answered"]) == len(self.forming["members"]):
                for member in self.forming["members"]:
                    self._send(member, "go", generation=self.generation)
                self.forming["started"] = True
                if len(self.forming["members"]) == 1:
                    self._formed()
        elif op == "port" and self.forming is not None:
            self.forming["port"] = message["port"]
            self._connect_next()
        elif op == "joined" and self.forming is not None:
            self._connect_next()
        elif op == "at_step" and self.news is not None and message["seq"] == self.news["seq"]:
            self.news["reports"][worker] = message["steps"]
        elif op == "form_failed" and self.abandoned != self.generation and (self.forming or worker in self.world):
            self._abandon_formation(None, f"worker {worker.label()} could not form it ({message['reason']})")

    def _announce(self, newcomer):
        """Tell the running world a worker is waiting to join: its next commit raises HostsUpdatedInterrupt."""
        if newcomer in self.announced:
            return
        self.announced.add(newcomer)
        _say(f"worker {newcomer.label()} is ready to join world {self.generation}")
        self._tell_world(added=True, removed=False)

    def _tell_world(self, added, removed):
        """Open the current world's round (see the module doc), unless it has one already."""
        if self.news is not None and self.news["generation"] == self.generation:
            return
        self.update_seq += 1
        self.news = {"generation": self.generation, "seq": self.update_seq, "added": added, "removed": removed,
                     "reports": {}, "answered": False}
        for member in self.world:
            if not member.gone:
                self._send(member, "hosts_updated", seq=self.update_seq, generation=self.generation, added=added,
                           removed=removed)

    def _answer_news(self):
        """Once every member of the world reported its steps (or is gone), tell them all the step to stop after."""
        news = self.news
        if news is None or news["answered"] or news["generation"] != self.generation or self.forming is not None:
            return
        if any(not w.gone and w not in news["reports"] for w in self.world):
            return
        news["answered"] = True
        steps = max(news["reports"].values(), default=0) + 1
        for member in self.world:
            if not member.gone:
                self._send(member, "stop_at", seq=news["seq"], generation=self.generation, steps=steps,
                           added=news["added"], removed=news["removed"])

    def _reap(self):
        for worker in self.workers:
            if worker.process.poll() is not None and not worker.gone:
                code = worker.process.returncode
                self._ended(worker, code)

    def _ended(self, worker, code):
        how = (f"was killed by signal {signal_name(-code)}" if code < 0 else f"exited with code {code}")
        if code == 0:
            worker.gone, worker.status = True, "finished"
            self._drop_connection(worker)
            if worker.generation is not None and worker in self.world:
                if not self.finishing:
                    _say(f"worker {worker.label()} (rank {worker.rank}) finished: the job is finishing")
                self.finishing = True
                self._stop_outsiders()
            return
        self._lost(worker, how)

    def _lost(self, worker, how):
        if worker.gone:
            return
        worker.gone, worker.status = True, how
        self._drop_connection(worker)
        if worker.process.poll() is None:
            kill_group(worker.process, signal.SIGKILL)
        if self.finishing and worker.generation is None:
            return          # stopped by us: not a failure
        now = time.monotonic()
        delay = self.blacklist.record_failure(worker.host, now)
        cooldown = "for good" if delay == float("inf") else f"for {delay:.0f} s"
        in_world = worker in self.world
        where = f" (rank {worker.rank} of world {self.generation})" if in_world else " before joining a world"
        if self.forming is not None and worker in self.forming["members"]:
            when = "while" if self.forming["started"] else "before"
            self._abandon_formation(worker, f"worker {worker.label()} {how} {when} it formed (host {worker.host} "
                                            f"blacklisted)")
            return
        survivors = [w for w in self.world if not w.gone]
        _say(f"worker {worker.label()}{where} {how}; host {worker.host} blacklisted {cooldown}"
             + (f"; {len(survivors)} workers left" if in_world else ""))
        if in_world:
            self.failed_at = self.failed_at or now
            for member in survivors:
                self._send(member, "peer_failed", generation=self.generation,
                           reason=f"worker {worker.label()} (rank {worker.rank}) {how}")

    def _drop_connection(self, worker):
        self.channel.drop(worker)

    # ------------------------------------------------------------------------------------------------ worlds
    def _maybe_form(self, now):
        """Form the next world once every survivor of the current one asked for it (all of them get the same
        error or interrupt), or, for the first world, once every worker started for it is ready."""
        if self.forming is not None:
            return
        members = [w for w in self.world if not w.gone]
        if any(w.ready_at is None for w in members):
            return                                  # the current world is still running
        if self.generation == 0 and any(not w.gone and w.ready_at is None for w in self.workers):
            return                                  # the first world waits for every worker started for it
        newcomers = [w for w in self.workers
                     if not w.gone and not w.removed and w.ready_at is not None and w not in members]
        if self.news is not None and not self.news["added"] and self.failed_at is None:
            newcomers = []          # the world stopped for removed workers only: its members will not sync
        for worker in [w for w in members if w.removed]:
            self._send(worker, "leave", reason=f"its slot {worker.label()} is no longer in the host list")
            worker.status, worker.generation, worker.rank = "left: its host was removed", None, None
            worker.ready_at = None
        members = [w for w in members if not w.removed]
        planned = sorted(members, key=lambda w: w.rank) + newcomers
        if any(w.held_state for w in self.workers) and not any(w.held_state for w in planned):
            raise ElasticJobError("every worker that held the training state is gone (died or left); the workers "
                                  "still alive never trained, so the job cannot go on from where it was")
        if self.max_np is not None:
            planned = planned[:self.max_np]
        if len(planned) < self.min_np:
            if not self._more_workers_possible():
                raise ElasticJobError(f"only {len(planned)} worker(s) left, fewer than --min-np {self.min_np}, and "
                                      f"no host can start another: every host is blacklisted for good "
                                      f"(--blacklist-cooldown-range lets a host back in after a cooldown; "
                                      f"--host-discovery-script can name new hosts)")
            if self.below_min_since is None:
                self.below_min_since = now
                _say(f"{len(planned)} worker(s) ready, below --min-np {self.min_np}: waiting up to "
                     f"{self.elastic_timeout_s:g} s (--elastic-timeout) for more")
            if now - self.below_min_since > self.elastic_timeout_s:
                raise ElasticJobError(f"only {len(planned)} worker(s) for {self.elastic_timeout_s:g} s "
                                      f"(--elastic-timeout), fewer than --min-np {self.min_np}")
            return
        self.below_min_since = None
        if self.generation > 0:
            self.resets += 1
            if self.reset_limit is not None and self.resets > self.reset_limit:
                raise ElasticJobError(f"the world would be re-formed {self.resets} time(s), more than "
                                      f"--reset-limit {self.reset_limit}")
        self._form(planned, now)

    def _more_workers_possible(self):
        """False when waiting for --elastic-timeout cannot help: no discovery script to name new hosts, no worker
        still starting, and every known host blacklisted for good or without a free slot."""
        if self.hosts.script is not None:
            return True
        if any(not w.gone and w.ready_at is None for w in self.workers):
            return True
        used = {(w.host, w.slot) for w in self.workers if not w.gone}
        return any(self.blacklist.until.get(host) != float("inf") and any((host, s) not in used for s in range(n))
                   for host, n in self.available.items())

    def _form(self, planned, now):
        old = set(self.world)
        self.generation += 1
        left = [w.label() for w in self.world if w not in planned]
        joined = [w.label() for w in planned if w not in old]
        _say(f"world {self.generation}: {len(planned)} workers"
             + (f"; left: {', '.join(left)}" if left else "") + (f"; joined: {', '.join(joined)}" if joined else ""))
        self.world, self.announced = [], set()
        for worker in self.workers:
            if worker.generation is not None and worker not in planned:
                worker.generation = worker.rank = None
        self.failed_at = None
        self.forming = {"members": planned, "next": 1, "deadline": now + self.formation_timeout_s, "port": None,
                        "answered": set(), "started": False}
        for rank, worker in enumerate(planned):
            worker.rank, worker.generation, worker.ready_at = rank, self.generation, None
            self._send(worker, "world", rank=rank, size=len(planned), generation=self.generation)

    def _abandon_formation(self, dead, what):
        """A planned worker died while world N formed (before the barrier let anyone into MPI, or inside its
        Accept/Connect), or a member's formation call failed: the others ask again and the next plan goes without
        the dead. A member stuck inside MPI exits after its connect timeout (one more death, seen as any other)."""
        planned = self.forming["members"] if self.forming is not None else self.world
        members = [w for w in planned if w is not dead and not w.gone]
        _say(f"world {self.generation} abandoned: {what}; planning again with the {len(members)} others")
        self.forming = None
        self.abandoned = self.generation
        self.world = members            # the next plan waits until each of them asked again
        for member in members:
            self._send(member, "abandon", generation=self.generation)

    def _connect_next(self):
        forming = self.forming
        members = forming["members"]
        if forming["next"] >= len(members):
            self._formed()
            return
        joiner = members[forming["next"]]
        forming["next"] += 1
        self._send(joiner, "connect", port=forming["port"], generation=self.generation)

    def _formed(self):
        self.world = self.forming["members"]
        self.forming = None
        self.news = None
        for worker in self.world:
            worker.held_state = True    # it synced this world's state (or will: a death in sync is handled there)
        for worker in self.workers:       # anyone who became ready meanwhile is news for the new world
            if not worker.gone and not worker.removed and worker.ready_at is not None and worker.generation is None:
                self._announce(worker)

    def _advance_formation(self, now):
        if self.forming is not None and now > self.forming["deadline"]:
            raise ElasticJobError(f"world {self.generation} was not formed within {self.formation_timeout_s:g} s")
        waiting = [w for w in self.world if not w.gone and w.ready_at is None]
        if self.failed_at is not None and waiting and now - self.failed_at > self.leave_timeout_s:
            # a survivor stuck where neither the abort nor its own leave watchdog reaches (elastic_worker): it is
            # lost, not the job -- one more death, and the others re-form without it
            for worker in waiting:
                self._lost(worker, f"did not leave world {self.generation} within {self.leave_timeout_s:g} s of a "
                                   f"failure in it (stuck; killed)")

    # ------------------------------------------------------------------------------------------------ the end
    def _stop_outsiders(self):
        for worker in self.workers:
            if not worker.gone and worker not in self.world:
                worker.status = "stopped: the job finished without it"
                worker.gone = True
                self._drop_connection(worker)
                kill_group(worker.process, signal.SIGTERM)

    def _final_status(self):
        failed = [w for w in self.world if w.status != "finished"]
        for worker in failed:
            _say(f"worker {worker.label()} (rank {worker.rank}) {worker.status}")
        return 1 if failed else 0

    def _stop_all(self):
        self.processes.stop_all(self.workers)
        self.channel.close()
