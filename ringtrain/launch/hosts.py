"""Which hosts and slots an elastic job may use: static `-H host:slots,...` or a discovery script, minus the hosts
blacklisted after failures (for a cooldown, or for good). Pure logic, no processes: the driver asks it questions.

The discovery-script contract (Horovod's): an executable that prints one line per available host, `hostname:slots`
or just `hostname` (then --slots applies), and exits 0. It is run again every few seconds; a host that disappears
takes its workers' slots away from new workers, one that appears offers new slots.
"""
import random
import re
import subprocess

HOST_LINE = re.compile(r"^\s*([^\s:#]+)(?::(\d+))?\s*$")


class DiscoveryError(RuntimeError):
    pass


def parse_hosts(text, default_slots=1, where="-H"):
    """'a:2,b' or lines of 'a:2' -> {"a": 2, "b": default_slots}, in order of appearance."""
    hosts = {}
    for item in re.split(r"[,\n]", text):
        item = item.split("#", 1)[0].strip()
        if not item:
            continue
        match = HOST_LINE.match(item)
        if not match:
            raise DiscoveryError(f"{where}: {item!r} is not 'hostname' or 'hostname:slots'")
        slots = int(match[2]) if match[2] else default_slots
        hosts[match[1]] = hosts.get(match[1], 0) + slots
    return hosts


def run_discovery(script, default_slots, timeout_s=10.0):
    try:
        done = subprocess.run([script], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise DiscoveryError(f"host discovery script {script!r} failed: {error}") from None
    if done.returncode != 0:
        raise DiscoveryError(f"host discovery script {script!r} exited with code {done.returncode}: "
                             f"{done.stderr.strip()[-500:]}")
    hosts = parse_hosts(done.stdout, default_slots, where=f"host discovery script {script!r}")
    if not hosts:
        raise DiscoveryError(f"host discovery script {script!r} printed no host (taken for a failure: a job with no "
                             f"host could not go on anyway)")
    return hosts


class Blacklist:
    """Hosts where a worker failed. Without a cooldown range a host stays out for good (Horovod's default); with
    (low, high) seconds it is out for low * 2^(failures-1) seconds, at most high, plus up to 10% jitter."""

    def __init__(self, cooldown_range=None, clock=None, rng=None):
        self.cooldown_range = cooldown_range
        self.failures = {}
        self.until = {}
        self.clock = clock
        self.rng = rng or random.Random()

    def record_failure(self, host, now):
        self.failures[host] = self.failures.get(host, 0) + 1
        if self.cooldown_range is None:
            self.until[host] = float("inf")
            return float("inf")
        low, high = self.cooldown_range
        delay = min(high, low * 2 ** (self.failures[host] - 1))
        delay += self.rng.uniform(0, 0.1 * delay)
        self.until[host] = now + delay
        return delay

    def blocked(self, host, now):
        return self.until.get(host, 0.0) > now


def free_slots(available, used, blacklist, now):
    """[(host, slot)] that a new worker may take: slots of hosts not blacklisted and not held by a live worker."""
    return [(host, slot) for host, slots in available.items() if not blacklist.blocked(host, now)
            for slot in range(slots) if (host, slot) not in used]


class HostWatch:
    """The hosts an elastic job may use: a fixed list, or what its discovery script prints, asked at most every
    `period_s` seconds. poll() returns the list when one was asked for (raising DiscoveryError when the script
    failed), None when it is not time yet or the list is fixed."""

    def __init__(self, static_hosts, script, slots, period_s=1.0):
        self.available = dict(static_hosts or {})
        self.script, self.slots, self.period_s = script, slots, period_s
        self.next_poll = 0.0

    def poll(self, now):
        if self.script is None or now < self.next_poll:
            return None
        self.next_poll = now + self.period_s
        return run_discovery(self.script, self.slots)
