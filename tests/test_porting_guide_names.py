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


HOROVOD_TORCH_NAMES = os.path.join(REPO, "tests", "data", "horovod_0_28_1_torch_names.txt")
SUBMODULES = ("mpi_ops", "compression", "functions", "optimizer", "sync_batch_norm", "elastic")


def horovod_torch_names():
    with open(HOROVOD_TORCH_NAMES, encoding="utf-8") as f:
        return {line.strip() for line in f if line.strip() and not line.startswith("#")}


def torch_table(text):
    """(first-column names, third-column text) of each row of the guide's horovod.torch table."""
    section = text.split("## horovod.torch\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or cells[0] == "horovod.torch" or set(cells[0]) <= set("- "):
            continue
        rows.append(([item.split("(", 1)[0].strip() for item in re.findall(r"`([^`]+)`", cells[0])], cells[2]))
    return rows


def torch_table_contradictions(text, horovod):
    """What the horovod.torch table says about Horovod 0.28.1 that is not so: a Horovod name the table leaves out, a
    first-column name horovod.torch does not export, an 'extra' (ringtrain-only) name that Horovod does export."""
    rows = torch_table(text)
    listed = {name.split(".", 1)[0] for names, _ in rows for name in names}
    problems = [f"horovod.torch.{name} is not in the table" for name in sorted(horovod - listed)]
    for names, differs in rows:
        for name in names:
            top = name.split(".", 1)[0]
            if top in horovod or top in SUBMODULES or name in ("process_set=", "horovodrun") \
                    or name.startswith("horovod."):
                continue
            problems.append(f"`{name}` is in the first column but horovod.torch 0.28.1 does not export it")
        for extra in re.findall(r"extra `([A-Za-z_]\w*)", differs):
            if extra in horovod:
                problems.append(f"`{extra}` is called a ringtrain extra but horovod.torch 0.28.1 exports it")
    return problems


def test_the_torch_table_matches_horovods_exports():
    with open(GUIDE, encoding="utf-8") as f:
        assert torch_table_contradictions(f.read(), horovod_torch_names()) == []


def test_fixture_is_homogeneous_is_not_a_horovod_torch_name():
    """The contradiction this check was written for: the table listed is_homogeneous among horovod.torch's names."""
    horovod = horovod_torch_names()
    assert "is_homogeneous" not in horovod and len(horovod) > 60
    good = ("## horovod.torch\n\n| horovod.torch | ringtrain.torch | how it differs |\n| --- | --- | --- |\n"
            "| `size`, `rank` | supported | extra `is_homogeneous()` |\n")
    assert [p for p in torch_table_contradictions(good, horovod) if "not in the table" not in p] == []
    bad = good.replace("| `size`, `rank` |", "| `size`, `rank`, `is_homogeneous` |")
    assert any("is_homogeneous" in p for p in torch_table_contradictions(bad, horovod))
    missing = torch_table_contradictions(good, horovod)
    assert "horovod.torch.allreduce is not in the table" in missing
    called_extra = good.replace("extra `is_homogeneous()`", "extra `barrier()`")
    assert any("barrier" in p and "extra" in p for p in torch_table_contradictions(called_extra, horovod))
