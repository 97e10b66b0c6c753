"""keep_freed_blocks: a large host block freed and made again every step (a gradient) stops costing fresh pages.

Each case runs in a fresh interpreter: the thresholds are process-wide and only ever raised."""
import json
import os
import subprocess
import sys

import pytest

from ringtrain import host_memory

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# 48 MB: past the 32 MB that glibc's own threshold adjustment can reach, so without the setting every
# allocation gets fresh pages (12,288 faults), as a large gradient would each step
STEPS = """
import ctypes, json, resource, sys
from ringtrain import host_memory
kept = host_memory.keep_freed_blocks(48 << 20, 96 << 20) if sys.argv[1] == "keep" else None
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
faults = []
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(48 << 20)         # as torch's CPU allocator does (no huge-page advice), every page touched
    ctypes.memset(block, 1, 48 << 20)
    libc.free(block)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"kept": kept, "faults": faults}))
"""


def run(mode, **env):
    environment = {k: v for k, v in os.environ.items() if k not in host_memory.USER_SETTINGS}
    environment.update(env, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", STEPS, mode], env=environment, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    return json.loads(out.splitlines()[-1])


@pytest.mark.skipif(host_memory._mallopt() is None, reason="the C library is not glibc")
def test_a_block_freed_every_step_keeps_its_pages():
    plain = run("plain")
    assert min(plain["faults"][1:]) > 10000, plain           # fresh pages every time: the cost being removed
    kept = run("keep")
    assert kept["kept"] is True
    assert max(kept["faults"][1:]) < 100, kept                  # after the first, the same pages again


@pytest.mark.skipif(host_memory._mallopt() is None, reason="the C library is not glibc")
def test_the_users_own_malloc_settings_are_left_alone():
    kept = run("keep", MALLOC_TOP_PAD_="131072")
    assert kept["kept"] is False
    assert min(kept["faults"][1:]) > 10000, kept


WRAPPED = """
import json, sys, torch
import ringtrain.torch as hvd
from ringtrain import host_memory
hvd.init()
model = torch.nn.Linear(3000, 3000)      # a 36 MB weight gradient
hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), overlap=False, **eval(sys.argv[1]))
print(json.dumps(host_memory._set))
hvd.shutdown()
"""


@pytest.mark.skipif(host_memory._mallopt() is None, reason="the C library is not glibc")
@pytest.mark.parametrize("options", ["{}", "{'shard': 'optimizer'}", "{'shard': 'gradients'}"])
def test_wrapping_a_cpu_model_keeps_blocks_as_large_as_its_gradients(options):
    environment = {k: v for k, v in os.environ.items() if k not in host_memory.USER_SETTINGS}
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", WRAPPED, options], env=environment, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    mmap_threshold, trim_threshold = json.loads(out.splitlines()[-1])
    assert mmap_threshold >= 2 * 36_000_000 and trim_threshold >= 4 * 36_012_000, (mmap_threshold, trim_threshold)
