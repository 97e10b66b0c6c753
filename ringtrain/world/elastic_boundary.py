"""The step boundary at which a world stops for workers added or removed, chosen by the driver: no collective per
step.

    boundary = StepBoundary(send)          # one per driver connection (elastic_worker.DriverClient)
    boundary.new_world(generation)         # the world this process is in now (its steps count from 0)
    decision = boundary.step_done()        # after each optimizer step: (seq, added, removed) once, else None

The driver tells every member of world g that workers were added or removed (`hosts_updated`). Each member's reader
thread answers at once with the steps it completed in g (`at_step`: c), and from then on does not complete step c+1
(its `step_done` waits there) until the driver's answer: `stop_at` T, with T = 1 + the largest c reported. Every
member completes step T (T > any c, and no member waited short of its own c+1, so nobody blocks the others' collectives
of steps up to T); step_done of step T returns the decision on every rank alike, and the next step's beginning raises
HostsUpdatedInterrupt there (elastic/lossless.py). Why T = max + 1 and not max: a member that reported c may already be
inside step c+1. The ranks of a world never differ by more than one completed step (each step's collectives need
every rank), so the wait for the answer -- sent as soon as every member's reader thread reported, milliseconds --
costs a step at most once per news, and a step without news costs a lock and an increment.

A death in the world (`peer_failed`) or the driver's going away ends the wait: that world is failing anyway.
"""
import threading

from ..errors import ElasticError


class StepBoundary:
    def __init__(self, send, worker_id, timeout_s):
        self._send = send                   # DriverClient.send
        self._worker_id = worker_id
        self._timeout_s = timeout_s         # for the driver's answer (it never takes that long: see the module doc)
        self._changed = threading.Condition(threading.Lock())
        self.generation = None              # the world this process is in (None before the first)
        self.steps = 0                      # optimizer steps completed in it
        self._reported = {}                 # generation -> the news (seq) this worker reported, awaiting the answer
        self._answers = {}                  # generation -> (steps T, seq, added, removed)
        self._broken = set()                # worlds whose waits end (a death in them, or the driver gone: None)

    def new_world(self, generation):
        with self._changed:
            self.generation, self.steps = generation, 0
            for table in (self._reported, self._answers):
                for old in [g for g in table if g < generation]:
                    del table[old]

    def heard(self, seq, generation):
        """The reader thread: the driver said workers were added to or removed from world `generation` (this one,
        or the one this process is still forming). Report how far this process got in it."""
        with self._changed:
            if self.generation is not None and generation < self.generation:
                return                      # about a world already left
            steps = self.steps if generation == self.generation else 0
            self._reported.setdefault(generation, seq)
        self._send("at_step", seq=seq, generation=generation, steps=steps)

    def answer(self, generation, steps, seq, added, removed):
        """The reader thread: the driver's `stop_at` for world `generation`."""
        with self._changed:
            self._answers[generation] = (steps, seq, added, removed)
            self._changed.notify_all()

    def broken(self, generation):
        """The reader thread: world `generation` failed (None: the driver went away); a wait for an answer ends."""
        with self._changed:
            self._broken.add(generation)
            self._changed.notify_all()

    def step_done(self):
        """After an optimizer step: count it; (seq, added, removed) when the driver's chosen step is this one."""
        with self._changed:
            self.steps += 1
            generation = self.generation
            if generation in self._reported and generation not in self._answers:
                # reported fewer steps than this: the answer may name this very step, so it must be here first
                if not self._changed.wait_for(lambda: self._answered_or_broken(generation), self._timeout_s):
                    raise ElasticError(f"worker {self._worker_id}: the elastic driver did not say within "
                                       f"{self._timeout_s:g} s at which step world {generation} stops for the "
                                       f"workers added or removed")
            answer = self._answers.get(generation)
            if answer is None or self.steps != answer[0]:
                return None
            del self._reported[generation]
            return answer[1:]

    def _answered_or_broken(self, generation):
        return generation in self._answers or generation in self._broken or None in self._broken
