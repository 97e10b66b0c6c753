"""ringtrain.csrc: finding the compiled sources and building a library on first use, as several ranks do at once."""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from ringtrain import csrc

CC = shutil.which("cc") or shutil.which("gcc") or shutil.which("c++")
pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler on PATH (cc, gcc or c++)")


def test_find_names_both_places_when_a_source_is_missing():
    assert os.path.isfile(os.path.join(csrc.find(["tf_host_call.cc"]), "tf_host_call.cc"))
    with pytest.raises(FileNotFoundError, match="no_such_source.cc.*_csrc.*csrc"):
        csrc.find(["tf_host_call.cc", "no_such_source.cc"])


def _source(tmp_path, body="int answer(void) { return 42; }\n"):
    path = tmp_path / "answer.c"
    path.write_text(body)
    return str(path)


def test_build_library_compiles_once_and_the_library_works(tmp_path):
    import ctypes
    target = str(tmp_path / "lib" / "libanswer.so")
    csrc.build_library([CC, "-shared", "-fPIC"], _source(tmp_path), target)
    assert ctypes.CDLL(target).answer() == 42
    built = os.stat(target).st_mtime_ns
    csrc.build_library([CC, "-shared", "-fPIC"], _source(tmp_path, "this is not C"), target)   # already there
    assert os.stat(target).st_mtime_ns == built
    assert [f for f in os.listdir(tmp_path / "lib") if f.endswith(".so")] == ["libanswer.so"]   # no partial left


def test_a_failing_compile_raises_with_the_compilers_words_and_leaves_no_library(tmp_path):
    target = str(tmp_path / "lib" / "libbroken.so")
    with pytest.raises(RuntimeError, match="exited"):
        csrc.build_library([CC, "-shared", "-fPIC"], _source(tmp_path, "this is not C\n"), target)
    assert not os.path.exists(target)
    assert [f for f in os.listdir(tmp_path / "lib") if f.endswith(".so")] == []


def test_ranks_building_together_load_one_whole_library(tmp_path):
    """Four processes start the same build at once: each loads a complete library (the lock and the atomic rename)."""
    source = _source(tmp_path)
    target = str(tmp_path / "lib" / "libanswer.so")
    code = textwrap.dedent(f"""
        import ctypes
        from ringtrain import csrc
        csrc.build_library([{CC!r}, "-shared", "-fPIC"], {source!r}, {target!r})
        print(ctypes.CDLL({target!r}).answer())
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [(p.returncode, out.strip()) for p, (out, _) in zip(procs, outputs)] == [(0, "42")] * 4, outputs


def test_built_names_the_library_by_source_key_and_command_and_reuses_it(tmp_path, monkeypatch):
    """An edited source (a planted bug too), another version key or other flags build a new library; the same
    inputs load the cached one."""
    import ctypes
    sources, cache = tmp_path / "csrc", tmp_path / "cache"
    sources.mkdir()
    monkeypatch.setattr(csrc, "find", lambda files: str(sources))
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    command = [CC, "-shared", "-fPIC"]
    (sources / "answer.c").write_text("int answer(void) { return 42; }\n")
    first = csrc.built("answer.c", command, key=["v1"])
    assert os.path.basename(first).startswith("answer-") and ctypes.CDLL(first).answer() == 42
    assert csrc.built("answer.c", command, key=["v1"]) == first
    assert csrc.built("answer.c", command, key=["v2"]) != first
    assert csrc.built("answer.c", command + ["-O2"], key=["v1"]) != first
    (sources / "answer.c").write_text("int answer(void) { return 43; }\n")
    edited = csrc.built("answer.c", command, key=["v1"])
    assert edited != first and ctypes.CDLL(edited).answer() == 43


def test_on_first_use_loads_once_and_keeps_the_reason_it_failed():
    calls = []

    def load():
        calls.append(1)
        return "module" if len(calls) == 1 else "again"
    library = csrc.OnFirstUse(load)
    assert library() == "module" and library() == "module" and len(calls) == 1

    def fail():
        calls.append(1)
        raise OSError("no compiler")
    broken = csrc.OnFirstUse(fail)
    assert broken() == "OSError: no compiler" and broken() == "OSError: no compiler" and len(calls) == 2
