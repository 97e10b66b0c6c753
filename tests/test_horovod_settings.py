"""A ported job's HOROVOD_* settings: each one either sets its ringtrain counterpart (a RINGTRAIN_* value of the same
setting wins) or makes init() warn once, saying what ringtrain does instead."""
import os
import subprocess
import sys
import warnings

import pytest

from ringtrain.config import HOROVOD_NOT_MAPPED, HOROVOD_SETTINGS, Config, horovod_warnings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (HOROVOD_* name, value, Config field, the value ringtrain must take, the RINGTRAIN_* value that wins over it)
MAPPINGS = [
    ("HOROVOD_FUSION_THRESHOLD", "67108864", "fusion_threshold", 67108864, "1048576"),
    ("HOROVOD_FUSION_THRESHOLD", "0", "fusion_threshold", 0, "4096"),
    ("HOROVOD_CYCLE_TIME", "3.5", "cycle_time_ms", 3.5, "0.5"),
    ("HOROVOD_CACHE_CAPACITY", "2048", "cache_capacity", 2048, "16"),
    ("HOROVOD_TIMELINE", "/tmp/hvd_timeline.json", "timeline", "/tmp/hvd_timeline.json", "/tmp/rt.json"),
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "7", "stall_warning_s", 7.0, "9"),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "42", "stall_timeout_s", 42.0, "50"),
    ("HOROVOD_HIERARCHICAL_ALLREDUCE", "1", "hierarchical", "1", "0"),
    ("HOROVOD_HIERARCHICAL_ALLREDUCE", "0", "hierarchical", "0", "auto"),
    ("HOROVOD_LOG_LEVEL", "trace", "log_level", "DEBUG", "ERROR"),
    ("HOROVOD_LOG_LEVEL", "fatal", "log_level", "CRITICAL", "INFO"),
    ("HOROVOD_LOG_LEVEL", "info", "log_level", "INFO", "ERROR"),
]


@pytest.fixture
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith(("HOROVOD_", "RINGTRAIN_")):
            monkeypatch.delenv(name)
    return monkeypatch


def test_every_mapped_setting_has_a_case_here():
    assert {m[0] for m in MAPPINGS} == set(HOROVOD_SETTINGS)


@pytest.mark.parametrize("horovod_name, raw, field, expected, ringtrain_raw", MAPPINGS,
                         ids=[f"{m[0]}={m[1]}" for m in MAPPINGS])
def test_horovod_setting_maps_and_ringtrain_wins(clean_env, horovod_name, raw, field, expected, ringtrain_raw):
    default = getattr(Config(), field)
    assert default != expected        # the mapping must visibly change something
    clean_env.setenv(horovod_name, raw)
    assert getattr(Config.from_env(), field) == expected
    assert not [m for m in horovod_warnings() if m.startswith(horovod_name + "=")]
    clean_env.setenv("RINGTRAIN_" + field.upper(), ringtrain_raw)
    won = getattr(Config.from_env(), field)
    assert won == type(expected)(float(ringtrain_raw)) if isinstance(expected, (int, float)) else won == ringtrain_raw
    assert getattr(Config.from_env(**{field: default}), field) == default      # init() keywords win over both


def test_horovod_timeline_dynamic_leaves_the_timeline_off(clean_env):
    clean_env.setenv("HOROVOD_TIMELINE", "DYNAMIC")
    assert Config.from_env().timeline == ""


def test_a_bad_horovod_value_names_the_variable(clean_env):
    clean_env.setenv("HOROVOD_CYCLE_TIME", "fast")
    with pytest.raises(ValueError, match="HOROVOD_CYCLE_TIME='fast'.*cycle_time_ms"):
        Config.from_env()
    clean_env.setenv("HOROVOD_CYCLE_TIME", "1")
    clean_env.setenv("HOROVOD_LOG_LEVEL", "loud")
    with pytest.raises(ValueError, match="HOROVOD_LOG_LEVEL"):
        Config.from_env()


# (HOROVOD_* name, a value that changes Horovod's behaviour, a word the warning must contain)
WARNED = [
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "0", "RINGTRAIN_STALL_TIMEOUT_S"),
    ("HOROVOD_STALL_CHECK_DISABLE", "1", "RINGTRAIN_STALL_WARNING_S"),
    ("HOROVOD_HIERARCHICAL_ALLGATHER", "1", "RINGTRAIN_HIERARCHICAL"),
    ("HOROVOD_AUTOTUNE", "1", "RINGTRAIN_FUSION_THRESHOLD"),
    ("HOROVOD_AUTOTUNE_LOG", "autotune.csv", "autotune"),
    ("HOROVOD_TIMELINE_MARK_CYCLES", "1", "RINGTRAIN_TIMELINE"),
    ("HOROVOD_MPI_THREADS_DISABLE", "1", "MPI_THREAD_MULTIPLE"),
    ("HOROVOD_CPU_OPERATIONS", "gloo", "RINGTRAIN_TRANSPORT"),
    ("HOROVOD_CONTROLLER", "gloo", "MPI"),
    ("HOROVOD_NUM_NCCL_STREAMS", "2", "stream"),
    ("HOROVOD_BATCH_D2D_MEMCOPIES", "0", "batched-copy"),
    ("HOROVOD_THREAD_AFFINITY", "0,1", "pin"),
    ("HOROVOD_DISABLE_GROUP_FUSION", "1", "fuses"),
    ("HOROVOD_ENABLE_ASYNC_COMPLETION", "1", "asynchronously"),
    ("HOROVOD_ADASUM_MPI_CHUNK_SIZE", "1048576", "not MPI chunks"),
    ("HOROVOD_ENABLE_XLA_OPS", "1", "XLA"),
    ("HOROVOD_GLOO_IFACE", "eth0", "Gloo"),
    ("HOROVOD_CCL_CACHE", "1", "oneCCL"),
]
# settings whose value can mean Horovod's default: no warning then
QUIET = [
    ("HOROVOD_STALL_CHECK_DISABLE", "0"), ("HOROVOD_AUTOTUNE", "0"), ("HOROVOD_CPU_OPERATIONS", "MPI"),
    ("HOROVOD_CONTROLLER", "mpi"), ("HOROVOD_HIERARCHICAL_ALLGATHER", "0"), ("HOROVOD_DYNAMIC_PROCESS_SETS", "1"),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "30"),
]


def test_every_warned_setting_has_a_case_here():
    assert {w[0] for w in WARNED} | {"HOROVOD_DYNAMIC_PROCESS_SETS"} == set(HOROVOD_NOT_MAPPED)


@pytest.mark.parametrize("name, raw, word", WARNED, ids=[w[0] for w in WARNED])
def test_unmapped_setting_warns_saying_what_ringtrain_does(clean_env, name, raw, word):
    assert horovod_warnings() == []
    clean_env.setenv(name, raw)
    messages = horovod_warnings()
    assert len(messages) == 1 and messages[0].startswith(f"{name}={raw} is ignored: ") and word in messages[0]


@pytest.mark.parametrize("name, raw", QUIET, ids=[f"{q[0]}={q[1]}" for q in QUIET])
def test_setting_at_horovods_default_is_quiet(clean_env, name, raw):
    clean_env.setenv(name, raw)
    assert horovod_warnings() == []


def test_init_warns_once_per_setting_and_applies_the_mapping(tmp_path):
    """A real init() in a fresh single-rank process: the mapped value is in force, each warning comes once."""
    code = ("import warnings, ringtrain as rt\n"
            "warnings.simplefilter('always')\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    rt.init()\n"
            "print('cycle', rt.config().cycle_time_ms)\n"
            "for w in caught:\n"
            "    print('WARN', w.message)\n"
            "rt.shutdown()\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "RINGTRAIN_"))}
    env.update(HOROVOD_CYCLE_TIME="2.5", HOROVOD_AUTOTUNE="1", HOROVOD_TIMELINE_MARK_CYCLES="1",
               PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert "cycle 2.5" in lines
    warned = [line for line in lines if line.startswith("WARN HOROVOD_")]
    assert sorted(w.split("=")[0] for w in warned) == ["WARN HOROVOD_AUTOTUNE", "WARN HOROVOD_TIMELINE_MARK_CYCLES"]


def test_porting_guide_lists_every_horovod_setting():
    with open(os.path.join(REPO, "docs", "porting", "horovod.md"), encoding="utf-8") as f:
        guide = f.read()
    section = guide.split("## HOROVOD_* settings", 1)[1].split("\n## ", 1)[0]
    for name, (field, _) in HOROVOD_SETTINGS.items():
        assert f"| `{name}` | `RINGTRAIN_{field.upper()}` |" in section, name
    for name in HOROVOD_NOT_MAPPED:
        assert f"`{name}`" in section, name
