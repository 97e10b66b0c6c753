"""Shared by the fault scripts: one line per event, prefixed with the rank, flushed at once so the test sees
what each rank said even when the job is torn down right after."""
import logging
import os
import sys
import threading
import time

import numpy as np

import ringtrain as rt


def say(*parts):
    rank = rt.rank() if rt.is_initialized() else os.environ.get("PMI_RANK", "?")
    # one write per line: the launcher forwards each rank's stdout in chunks, so pieces could interleave
    sys.stdout.write(" ".join([f"rank {rank}:", *map(str, parts)]) + "\n")
    sys.stdout.flush()


def caught(case, error):
    """The line the test looks for: which case, which error type, and the error's own message."""
    say(f"CAUGHT[{case}] {type(error).__name__}: {error}")


def done_speaking():
    """This rank has printed every line the test needs from it: under the fault tests' WAIT_FOR_SPEAKERS shell
    (RINGTRAIN_TEST_SPOKE: a directory), a file named after the rank there lets a rank that ended non-zero stop
    keeping hydra from ending the others once every rank the test expects to speak has."""
    directory = os.environ.get("RINGTRAIN_TEST_SPOKE")
    if directory:
        rank = rt.rank() if rt.is_initialized() else os.environ.get("PMI_RANK", "unknown")
        open(os.path.join(directory, str(rank)), "w").close()


def announce_pid():
    say(f"PID {os.getpid()}")


def check_usable(tag="after"):
    """A correct Sum allreduce after an error: proves the job stays usable."""
    got = rt.allreduce(np.full(5, rt.rank() + 1.0, np.float32), op=rt.Sum, name=f"usable.{tag}")
    want = np.full(5, rt.size() * (rt.size() + 1) / 2, np.float32)
    if not np.array_equal(got, want):
        say(f"WRONG usable result {got} != {want}")
        sys.exit(5)
    say("USABLE")


class _StallWarnings(logging.Handler):
    """The names ringtrain's stall warnings have named on this rank so far (each name warned of once)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.named, self.changed = set(), threading.Condition()

    def emit(self, record):
        message = record.getMessage()
        if record.levelno == logging.WARNING and " has waited " in message:
            with self.changed:
                self.named.add(message.split("tensor ", 1)[1].split(" has waited ", 1)[0])
                self.changed.notify_all()


_warnings = _StallWarnings()
# on the root logger, which ringtrain's records reach too: a handler on "ringtrain" itself before init() would stand
# in for ringtrain's own stderr handler (init() adds it only to a logger without handlers)
logging.getLogger().addHandler(_warnings)


def wait_for_stall_warning(name, timeout_s=30.0):
    """Block until this rank's engine warns that `name` has waited (RINGTRAIN_STALL_WARNING_S): rank 0's coordinator
    then holds the peers' submission of `name`, so whatever this rank submits next is younger than it, whatever the
    load. (The order a sleep would only make likely.) Exits the rank (code 6) when no warning comes."""
    deadline = time.monotonic() + timeout_s
    with _warnings.changed:
        while repr(name) not in _warnings.named:
            left = deadline - time.monotonic()
            if left <= 0:
                say(f"NO STALL WARNING for {name!r} within {timeout_s:g} s")
                sys.exit(6)
            _warnings.changed.wait(left)
