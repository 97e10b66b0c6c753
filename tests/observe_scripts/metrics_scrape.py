"""A 2-rank job with RINGTRAIN_METRICS_PORT / RINGTRAIN_METRICS_FILE set (argv: port, file, flight recorder dir):
rank 0 scrapes every rank's endpoint over HTTP during the job and checks the counters against the collectives the
job ran, twice (they must move); every rank writes its flight recorder on SIGUSR1 and the file ends with the last
collective it ran. Prints OK lines; exits non-zero on the first wrong number."""
import os
import signal
import sys
import time
import urllib.request

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

import ringtrain as rt

port, path, flight_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
rt.init()
rank, size = rt.rank(), rt.size()


def fail(message):
    print(f"rank {rank}: WRONG {message}", flush=True)
    sys.exit(3)


def scrape(r):
    with urllib.request.urlopen(f"http://127.0.0.1:{port + r}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples, name, **labels):
    key = (name, tuple(sorted(labels.items())))
    if key not in samples:
        fail(f"no sample {name}{labels} in the scrape")
    return samples[key]


x = np.ones(1024, np.float32)                      # 4 KB
for i in range(7):
    rt.allreduce(x, op=rt.Sum, name="metrics.grad")
for i in range(3):
    rt.allgather(np.ones((2, 3), np.float32), name=f"metrics.gather{i}")
rt.broadcast(np.ones(16, np.float32), root_rank=0, name="metrics.weights")
rt.barrier()
expected = {"allreduce": (7, 7 * 4096), "allgather": (3, 3 * 24), "broadcast": (1, 64)}
if rank == 0:
    for r in range(size):
        samples = scrape(r)
        for kind, (count, nbytes) in expected.items():
            labels = dict(rank=str(r), process_set="0", kind=kind)
            got = value(samples, "ringtrain_collectives_total", **labels)
            if got != count:
                fail(f"rank {r} {kind} count {got}, ran {count}")
            got = value(samples, "ringtrain_collective_bytes_total", **labels)
            if got != nbytes:
                fail(f"rank {r} {kind} bytes {got}, ran {nbytes}")
            if value(samples, "ringtrain_collective_seconds_total", **labels) <= 0:
                fail(f"rank {r} {kind}: no time")
        if value(samples, "ringtrain_stalls_total", rank=str(r), process_set="0") != 0:
            fail("a stall counted in a job without one")
    print("rank 0: OK first scrape", flush=True)
rt.barrier()
for i in range(5):
    rt.allreduce(x, op=rt.Sum, name="metrics.grad")
rt.barrier()
if rank == 0:
    for r in range(size):
        got = value(scrape(r), "ringtrain_collectives_total", rank=str(r), process_set="0", kind="allreduce")
        if got != 12:
            fail(f"rank {r}: allreduce count {got} after 12 allreduces")
    print("rank 0: OK second scrape", flush=True)
rt.barrier()

# the flight recorder on a signal: the file's last entry is the last collective this rank ran
rt.allreduce(x, op=rt.Sum, name="metrics.last")
os.kill(os.getpid(), signal.SIGUSR1)
dump = os.path.join(flight_dir, f"rank{rank}.json")
deadline = time.monotonic() + 5
while not os.path.exists(dump) and time.monotonic() < deadline:
    time.sleep(0.01)
import json  # noqa: E402
with open(dump) as f:
    record = json.load(f)
last = record["collectives"][-1]
if last["name"] != "metrics.last" or last["state"] != "completed" or record["reason"] != "signal SIGUSR1":
    fail(f"the dump ends with {last} ({record['reason']})")
print(f"rank {rank}: OK dump", flush=True)
rt.barrier()
rt.shutdown()
print(f"rank {rank}: DONE", flush=True)
