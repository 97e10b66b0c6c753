"""Automatic collective names: deterministic across ranks as long as every rank makes the same calls in the same
order. Reset at init() so a re-initialised job starts from the same names on every rank.

The core API's unnamed calls take their names from a short cycle (slot_name): the n-th unnamed allreduce of a
process set is "allreduce.noname.<n mod UNNAMED_SLOTS>". The same few names recur, so after the first few calls an
unnamed collective is a cached one -- the response cache hits and the engine's express path applies, as for a named
call -- while ranks still match calls by their position in program order (a mismatch names the slot and each
rank's shape). A slot is reused only once its previous collective has finished on this rank (the caller drives the
engine until it has), so UNNAMED_SLOTS unnamed asynchronous calls of one kind may be in flight at a time."""
import collections
import threading

_counters = collections.Counter()
_lock = threading.Lock()


def _given(name):
    """A name the caller gave: a non-empty str, else TypeError."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    return name


def auto_name(kind, name):
    if name is not None:
        return _given(name)
    with _lock:
        _counters[kind] += 1
        return f"{kind}.noname.{_counters[kind]}"


UNNAMED_SLOTS = 8
_slot_names = {}        # kind -> its UNNAMED_SLOTS names


def slot_name(kind, name):
    """`name` when given, else the next of UNNAMED_SLOTS names of `kind` in call order (see above)."""
    if name is not None:
        return _given(name)
    with _lock:
        n = _counters[kind]
        _counters[kind] = n + 1
    names = _slot_names.get(kind)
    if names is None:           # made once per kind: an unnamed call in every step formats no string
        names = _slot_names[kind] = tuple(f"{kind}.noname.{i}" for i in range(UNNAMED_SLOTS))
    return names[n % UNNAMED_SLOTS]


def next_number(kind):
    """1, 2, 3, ... per kind: a binding's own auto names (e.g. TensorFlow's eager "tf.allreduce.7") count here, so
    they restart with the core's at init()."""
    with _lock:
        _counters[kind] += 1
        return _counters[kind]


def reset():
    with _lock:
        _counters.clear()
