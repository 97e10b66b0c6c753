"""die_with_parent: a child process started with preexec_fn=die_with_parent is SIGKILLed by the kernel when the
process that started it dies (PR_SET_PDEATHSIG, Linux only; elsewhere nothing happens), so an mpiexec started for a
Spark/Ray task or an elastic worker never outlives what started it."""
import ctypes
import signal


def die_with_parent():
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)     # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 -- best effort (Linux only)
        pass
