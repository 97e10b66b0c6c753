"""Shared by the fault scripts: one line per event, prefixed with the rank, flushed at once so the test sees
what each rank said even when the job is torn down right after."""
import os
import sys

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
