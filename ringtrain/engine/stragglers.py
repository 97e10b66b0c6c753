"""Straggler scores: how long the other ranks waited for each rank, and a log line on rank 0 naming a rank that makes
them wait.

Where the waits come from (cycle_agreement.py, CycleAgreement._exchange_slots): a rank that offers collectives in an
agreement cycle and cannot run them -- a peer lacks them, or has not reached the cycle -- is waiting for that peer.
When its collectives do run, the time since it began waiting goes to the peer it waited for (add_wait). Nothing is
measured while nobody waits (nor waits shorter than WAIT_FLOOR_S, the exchange's own handshake), and nothing is
sent: each rank keeps its running totals in its own slots of the cycle
exchange, which the peers hold anyway (cycle_exchange.py). Rank 0 reads everyone's totals every straggler_window_s
(from the engine's background thread, off the collective path) and judges the window.

A rank p is a straggler in a window when, averaged over the other ranks, they waited for it at least
straggler_share of the window, and at least straggler_min_ms per wait on average: then rank 0 logs one line
naming it, its host and what it cost, at most once per straggler_log_interval_s per rank.
"""
import logging
import time

from .cycle_exchange import WAIT_FLOOR_S

log = logging.getLogger("ringtrain")


class Stragglers:
    """One engine's straggler accounting over its agreement's exchange (None on the coordinator protocol)."""

    def __init__(self, exchange, rank, hosts, config, timeline_of=lambda: None, label=""):
        self.exchange = exchange
        self.rank, self.size, self.hosts = rank, len(hosts), hosts
        self.config = config
        self.label = label                     # "" for the world, "process set 2" for a set's engine
        self._timeline_of = timeline_of        # () -> the engine's timeline (or None)
        self._window_start = time.monotonic()
        self._window_rows = exchange.wait_rows()
        self._last_logged = {}                 # rank -> monotonic time of its last log line
        self.last_window = None                # the last judged window: {"seconds", "ranks": {rank: {...}}}
        self.waiting = False                   # what we offered in the last cycle did not all run
        self.wait_start = None                 # perf_counter time we began waiting, or None
        self.blame = None                      # the peer we wait for
        self.lacking = ()                      # the peers that lacked our ids in the last cycle that could not run them

    # ---- the agreement's side (progress lock held) ------------------------------------------------------
    def after_cycle(self, c, offered, ready, flags, waited, words):
        """Cycle c, in which this rank offered the ids `offered` and `ready` turned out ready everywhere; called
        only when something is to be learnt: the gather waited (`waited`: (peer, start)), a flag sent everything to
        the coordinator, a peer lacked some of our ids, or we were already waiting."""
        if waited is not None and self.wait_start is None:
            self.wait_start, self.blame = waited[1], waited[0]
        if flags:                    # everything goes to the coordinator: no cycle's wait to measure
            self._reset()
        elif ready != offered:       # peers lack some of what we offered: we wait for them
            exchange = self.exchange
            lacking = [p for p in exchange.peers if offered & ~exchange.bitmap(p, words)]
            if lacking:
                self.lacking, self.blame = lacking, lacking[0]
            if self.wait_start is None:
                self.wait_start = time.perf_counter()
            self.waiting = True
        else:                        # everything we offered runs now: the wait was for the last of the lacking
            if self.wait_start is not None:
                lacking = self.lacking
                if len(lacking) > 1:
                    # several lacked it in the last cycle that could not run it: the one whose arrival started
                    # this cycle came last (we followed it in), else the one this cycle's gather waited for
                    leader = self.exchange.leader
                    if leader is not None and leader[0] == c and leader[1] in lacking:
                        self.blame = leader[1]
                    elif waited is not None and waited[0] in lacking:
                        self.blame = waited[0]
                end = time.perf_counter()
                if self.blame is not None and end - self.wait_start >= WAIT_FLOOR_S:
                    self.add_wait(self.blame, self.wait_start, end)
            self._reset()

    def _reset(self):
        self.wait_start = self.blame = None
        self.lacking = ()
        self.waiting = False

    def add_wait(self, peer, start, end):
        """This rank waited for `peer` from `start` to `end` (perf_counter seconds)."""
        self.exchange.add_wait(peer, end - start)
        timeline = self._timeline_of()
        if timeline is not None:
            timeline.wait_mark(peer, start, end)

    # ---- rank 0's judgement (the engine's background thread) -------------------------------------------
    def maybe_judge(self, now):
        """Judge the window when it is over (rank 0 only; any rank may call it)."""
        if now - self._window_start < self.config.straggler_window_s:
            return None
        return self.judge(now)

    def judge(self, now=None):
        """Close the current window: per rank, the share of it the others spent waiting for that rank and the
        mean wait; log the stragglers (rank 0). Returns the window's verdict (also kept as last_window)."""
        now = time.monotonic() if now is None else now
        rows = self.exchange.wait_rows()
        seconds = max(now - self._window_start, 1e-9)
        before = self._window_rows
        self._window_rows, self._window_start = rows, now
        ranks = {}
        others = max(self.size - 1, 1)
        for p in range(self.size):
            us = sum(rows[q][p][0] - before[q][p][0] for q in range(self.size) if q != p)
            count = sum(rows[q][p][1] - before[q][p][1] for q in range(self.size) if q != p)
            share = us * 1e-6 / others / seconds
            ranks[p] = {"share": share, "waits": count, "mean_ms": us * 1e-3 / count if count else 0.0,
                        "host": self.hosts[p]}
        window = {"seconds": seconds, "ranks": ranks}
        self.last_window = window
        if self.rank == 0:
            for p, verdict in ranks.items():
                if self.is_straggler(verdict):
                    self._log(p, verdict, seconds, now)
        return window

    def is_straggler(self, verdict):
        return (verdict["share"] >= self.config.straggler_share
                and verdict["mean_ms"] >= self.config.straggler_min_ms)

    def _log(self, p, verdict, seconds, now):
        last = self._last_logged.get(p)
        if last is not None and now - last < self.config.straggler_log_interval_s:
            return
        self._last_logged[p] = now
        where = f" of {self.label}" if self.label else ""
        log.warning("straggler: rank %d%s on %s made the others wait %.0f%% of the last %.1f s, %.1f ms a wait "
                    "(%d waits; RINGTRAIN_STRAGGLER_SHARE=%g)", p, where, verdict["host"], verdict["share"] * 100,
                    seconds, verdict["mean_ms"], verdict["waits"], self.config.straggler_share)

    # ---- the report ---------------------------------------------------------------------------------------
    def report(self):
        """Per rank: the totals since the start (seconds the others waited for it, how many waits) and the last
        judged window's share and mean, with the ranks judged stragglers in that window."""
        rows = self.exchange.wait_rows()
        window = self.last_window
        ranks = []
        for p in range(self.size):
            us = sum(rows[q][p][0] for q in range(self.size) if q != p)
            count = sum(rows[q][p][1] for q in range(self.size) if q != p)
            entry = {"rank": p, "host": self.hosts[p], "waited_s": us * 1e-6, "waits": count,
                     "waited_by_this_rank_s": rows[self.rank][p][0] * 1e-6}
            if window is not None:
                verdict = window["ranks"][p]
                entry.update(window_share=verdict["share"], window_mean_ms=verdict["mean_ms"],
                             straggler=self.is_straggler(verdict))
            ranks.append(entry)
        return {"ranks": ranks, "window_s": window["seconds"] if window else None,
                "stragglers": [e["rank"] for e in ranks if e.get("straggler")]}
