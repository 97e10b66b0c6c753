"""Every name the porting guide's tables mark as supported exists under the ringtrain module it names: the guide
cannot promise a Horovod name that ringtrain lacks."""
import functools
import importlib
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUIDE = os.path.join(REPO, "docs", "porting", "horovod.md")
SECTIONS = {"## horovod.torch": "ringtrain.torch", "## horovod.tensorflow and horovod.tensorflow.keras":
            "ringtrain.tensorflow"}


def supported_names():
    """(ringtrain module, dotted name) for every backticked name in the first column of a 'supported' row."""
    with open(GUIDE, encoding="utf-8") as f:
        text = f.read()
    found = []
    for heading, module in SECTIONS.items():
        section = text.split(heading + "\n", 1)[1].split("\n## ", 1)[0]
        for line in section.splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) < 3 or cells[1] != "supported":
                continue
            for item in re.findall(r"`([^`]+)`", cells[0]):
                name = item.split("(", 1)[0].strip()
                name = name[len("hvd."):] if name.startswith("hvd.") else name
                if not re.fullmatch(r"[A-Za-z_][\w.]*", name) or name.startswith("horovod."):
                    continue           # `process_set=` on every collective: an argument; Horovod's own paths
                if name.startswith("keras."):
                    found.append(("ringtrain.keras", name[len("keras."):]))
                else:
                    found.append((module, name))
    return found


NAMES = supported_names()


def test_the_tables_were_read():
    assert len(NAMES) > 80
    assert ("ringtrain.tensorflow", "PartialDistributedGradientTape") in NAMES
    assert ("ringtrain.keras", "callbacks.BroadcastGlobalVariablesCallback") in NAMES


@pytest.mark.parametrize("module, name", NAMES, ids=[f"{m}.{n}" for m, n in NAMES])
def test_supported_name_exists(module, name):
    if name in ("mpi_ops", "compression", "functions", "optimizer", "sync_batch_norm", "elastic"):
        importlib.import_module(f"{module}.{name}")      # Horovod's submodule paths
    functools.reduce(getattr, name.split("."), importlib.import_module(module))
