"""Automatic collective names: deterministic across ranks as long as every rank makes the same calls in the same
order. Reset at init() so a re-initialised job starts from the same names on every rank."""
import collections
import threading

_counters = collections.Counter()
_lock = threading.Lock()


def auto_name(kind, name):
    if name is not None:
        if not isinstance(name, str) or not name:
            raise TypeError(f"name must be a non-empty str, got {name!r}")
        return name
    with _lock:
        _counters[kind] += 1
        return f"{kind}.noname.{_counters[kind]}"


def next_number(kind):
    """1, 2, 3, ... per kind: a binding's own auto names (e.g. TensorFlow's eager "tf.allreduce.7") count here, so
    they restart with the core's at init()."""
    with _lock:
        _counters[kind] += 1
        return _counters[kind]


def reset():
    with _lock:
        _counters.clear()
