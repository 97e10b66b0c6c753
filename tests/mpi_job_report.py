"""pytest plugin for the ranks of a tests/test_parallel.py job (`-p mpi_job_report`): the job must really have run.

- RINGTRAIN_TEST_WORLD_SIZE=N: at session start, a rank whose MPI world is not N ends at once (exit 3). An mpiexec of
  another MPI than mpi4py's starts N singletons, each a world of 1 where every test skips and pytest exits 0.
- RINGTRAIN_TEST_REPORT_DIR=dir: at session end each rank writes rank<r>.json there (world size, passed count, skip
  reasons), which the launcher checks instead of parsing N ranks' interleaved output.
"""
import json
import os

import pytest

EXPECTED_WORLD_SIZE = "RINGTRAIN_TEST_WORLD_SIZE"
REPORT_DIR = "RINGTRAIN_TEST_REPORT_DIR"


def pytest_sessionstart(session):
    expected = os.environ.get(EXPECTED_WORLD_SIZE)
    if not expected:
        return
    from mpi4py import MPI
    actual = MPI.COMM_WORLD.Get_size()
    if actual != int(expected):
        pytest.exit(f"this rank sees an MPI world of {actual} process(es) but the launcher started {expected} "
                    f"({EXPECTED_WORLD_SIZE}); mpiexec and mpi4py are probably not the same MPI "
                    f"(mpi4py: {MPI.Get_library_version().splitlines()[0]})", returncode=3)


def pytest_sessionfinish(session, exitstatus):
    directory = os.environ.get(REPORT_DIR)
    if not directory:
        return
    from mpi4py import MPI
    stats = session.config.pluginmanager.get_plugin("terminalreporter").stats
    skip_reasons = [report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
                    for report in stats.get("skipped", [])]
    rank = MPI.COMM_WORLD.Get_rank()
    with open(os.path.join(directory, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world_size": MPI.COMM_WORLD.Get_size(), "exitstatus": int(exitstatus),
                   "passed": len([r for r in stats.get("passed", []) if r.when == "call"]),
                   "failed": len(stats.get("failed", [])), "skipped": skip_reasons}, f)
