"""gpu.wait_for_event, the GPU transports' sync: poll first, then sleep. Runs without a GPU on a fake event."""
import itertools

from ringtrain import gpu


class FakeEvent:
    """done after `ready_after` queries; counts queries and blocking synchronizes."""

    def __init__(self, ready_after):
        self.ready_after = ready_after
        self.queries = 0
        self.synchronized = 0

    @property
    def done(self):
        self.queries += 1
        return self.queries > self.ready_after

    def synchronize(self):
        self.synchronized += 1


def clock(step_s):
    ticks = itertools.count()
    return lambda: next(ticks) * step_s


def test_an_event_done_within_the_spin_is_never_slept_on():
    event = FakeEvent(ready_after=3)
    gpu.wait_for_event(event, spin_s=1.0, clock=clock(0.01))
    assert (event.queries, event.synchronized) == (4, 0)


def test_an_event_still_running_after_the_spin_is_slept_on_once():
    event = FakeEvent(ready_after=10**9)
    gpu.wait_for_event(event, spin_s=0.05, clock=clock(0.01))
    assert event.synchronized == 1
    assert 1 <= event.queries <= 5          # polling stopped when the budget ran out


def test_no_spin_sleeps_at_once():
    event = FakeEvent(ready_after=0)
    gpu.wait_for_event(event, spin_s=0, clock=clock(0.01))
    assert (event.queries, event.synchronized) == (0, 1)
