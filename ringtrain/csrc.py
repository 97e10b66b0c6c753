"""ringtrain's compiled sources, built on first use: where they are (ringtrain/_csrc in an installed wheel, which
setup.py copies csrc/ into, else <repo>/csrc in a source checkout or editable install), and how a library is built
once per machine and loaded once per process.

    path = csrc.built("stream_copy.c", command)                  # compiled into the per-user cache if not there
    module = csrc.load_extension("_stream_copy", path)           # a CPython extension module
    library = csrc.OnFirstUse(load)                              # library(): load()'s result, or why it failed

A library's file name hashes its source text, the platform, the versions it depends on and the compiler command,
so an edited source (a planted bug included), an upgrade or other flags build afresh and everything else loads the
cached file.
"""
import hashlib
import importlib.machinery
import importlib.util
import os
import sys
import threading


def find(files):
    """The directory holding every one of `files` (names of csrc/ sources)."""
    here = os.path.dirname(os.path.abspath(__file__))
    candidates = (os.path.join(here, "_csrc"), os.path.join(os.path.dirname(here), "csrc"))
    for candidate in candidates:
        if all(os.path.isfile(os.path.join(candidate, f)) for f in files):
            return candidate
    raise FileNotFoundError(f"ringtrain's sources ({', '.join(files)}) are neither in {candidates[0]} nor in "
                            f"{candidates[1]}; reinstall ringtrain (the wheel ships them as ringtrain/_csrc)")


BUILD_TIMEOUT_S = 300


def cache_dir():
    """Where libraries built on first use live: `$XDG_CACHE_HOME/ringtrain`, else `~/.cache/ringtrain`."""
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                        "ringtrain")


def build_library(command, source, target, timeout=BUILD_TIMEOUT_S):
    """Compile `source` (a path, or a list of paths compiled together) into the shared library `target` with
    `command` (a list: compiler and flags; the sources and `-o target` are added), atomically: ranks starting together take a file lock, one compiles and the others load
    its library, and a peer never loads a half-written file. Raises OSError, RuntimeError or a subprocess error."""
    import fcntl
    import subprocess
    import tempfile
    folder = os.path.dirname(target)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "build.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(target):            # a peer built it while we waited
            return
        fd, partial = tempfile.mkstemp(suffix=".so", dir=folder)
        os.close(fd)
        try:
            sources = [source] if isinstance(source, str) else list(source)
            done = subprocess.run(list(command) + sources + ["-o", partial], capture_output=True, text=True,
                                  timeout=timeout)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(command)} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
            os.replace(partial, target)
        finally:
            if os.path.exists(partial):
                os.remove(partial)


def built(source_name, command, key=(), suffix=".so", timeout=BUILD_TIMEOUT_S, also=()):
    """The path of csrc/`source_name` compiled with `command` (see build_library), built now if the cache lacks it.
    `key`: the versions the library depends on (Python's, a framework's), hashed into its name with the source text,
    the platform and the command. `also`: more csrc/ files of the same library -- sources (.c) compiled with it,
    headers it includes -- whose text is hashed too."""
    folder = find([source_name, *also])
    paths = [os.path.join(folder, name) for name in (source_name, *also)]
    texts = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            texts.append(f.read())
    digest = hashlib.sha256("\0".join([*texts, sys.platform, *key, *command]).encode()).hexdigest()[:16]
    target = os.path.join(cache_dir(), f"{os.path.splitext(source_name)[0]}-{digest}{suffix}")
    if not os.path.exists(target):
        build_library(command, [p for p in paths if p.endswith((".c", ".cc"))], target, timeout)
    return target


def load_extension(name, path):
    """The CPython extension module `name` from the shared library at `path`."""
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


class OnFirstUse:
    """Calls `load` once per process, on first use, under a lock; afterwards returns what it returned, or a str saying
    why it raised (no compiler, a build error or timeout, a library that will not load): callers fall back."""

    def __init__(self, load):
        self._load = load
        self._lock = threading.Lock()
        self._value = None

    def __call__(self):
        with self._lock:
            if self._value is None:
                try:
                    self._value = self._load()
                except Exception as e:
                    self._value = f"{type(e).__name__}: {e}"
            return self._value
