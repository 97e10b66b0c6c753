"""Where ringtrain's compiled sources are: ringtrain/_csrc in an installed wheel (setup.py copies csrc/ there),
else <repo>/csrc in a source checkout or editable install."""
import os


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
    """Compile `source` into the shared library `target` with `command` (a list: compiler and flags; the source and
    `-o target` are added), atomically: ranks starting together take a file lock, one compiles and the others load
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
            done = subprocess.run(list(command) + [source, "-o", partial], capture_output=True, text=True,
                                  timeout=timeout)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(command)} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
            os.replace(partial, target)
        finally:
            if os.path.exists(partial):
                os.remove(partial)
