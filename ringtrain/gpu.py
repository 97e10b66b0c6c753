"""GPU detection, binding and the device half of fusion (DeviceOps), with the engine's communication stream.

    from ringtrain import gpu
    if gpu.available():             # False, silently, when cupy is missing or no CUDA device/driver works
        gpu.bind(local_rank)        # current device = local_rank % device_count

Streams: the engine thread runs every device collective on one dedicated communication stream per device.
At submit time `ready_event()` is recorded on the caller's current stream; the engine makes the comm stream wait
on it (`wait_event`, a GPU-side dependency, not a host sync) before packing; after unpacking `done_event()` is
recorded on the comm stream and Handle.wait() synchronises that event only. So gradients produced on the
compute stream are reduced while the compute stream goes on with the rest of backward.

Importing this module does not import cupy: `available()` and `is_device_array()` work on machines without it.
"""
import sys
import threading
import time

_lock = threading.Lock()
_available = None
_bound = None          # device id chosen by bind()
_device_ops = None


def _driver_device_count():
    """Devices the CUDA driver reports, asked through libcuda with ctypes so that a machine without a working
    driver never imports cupy (0 when libcuda is missing or cuInit fails)."""
    import ctypes
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        count = ctypes.c_int(0)
        if libcuda.cuInit(0) != 0 or libcuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return 0
        return count.value
    except (OSError, AttributeError):
        return 0


def available():
    """True when the driver sees a device, cupy imports and its runtime agrees; anything else (no libcuda,
    cudaErrorInsufficientDriver, zero devices, no cupy) means False, without a message."""
    global _available
    if _available is None:
        _available = False
        if _driver_device_count() > 0:
            try:
                import cupy
                _available = cupy.cuda.runtime.getDeviceCount() > 0
            except Exception:
                _available = False
    return _available


def choose_device(index, device_count):
    """The device a process with this index (local rank, or elastic slot) takes: index % device_count."""
    return int(index) % device_count


def bind(local_rank):
    """Make device local_rank % device_count current for this thread (and the engine's); return its id,
    or None when no GPU is available."""
    global _bound
    if not available():
        return None
    import cupy
    device = choose_device(local_rank, cupy.cuda.runtime.getDeviceCount())
    cupy.cuda.Device(device).use()
    _bound = device
    return device


def bound_device():
    """The device bind() chose, else the current one."""
    if _bound is not None:
        return _bound
    import cupy
    return cupy.cuda.runtime.getDevice()


def device_identity():
    """Something equal for two processes exactly when they use the same physical GPU (its PCI bus id), so the
    engine can tell 'one GPU per rank' (NCCL) from 'ranks share a GPU' (CUDA IPC)."""
    import cupy
    return cupy.cuda.Device(bound_device()).pci_bus_id


def is_device_array(x):
    """True for cupy arrays and any object exposing __cuda_array_interface__ (torch CUDA tensors, numba).
    Never imports cupy: if it isn't loaded, x cannot be a cupy array."""
    if hasattr(x, "__cuda_array_interface__"):
        return True
    cupy = sys.modules.get("cupy")
    return cupy is not None and isinstance(x, cupy.ndarray)


def from_dlpack(x):
    """A cupy array sharing memory with x (a DLPack-capable object such as a torch CUDA tensor)."""
    import cupy
    return cupy.from_dlpack(x)


def as_cupy(x):
    """x itself when it is a cupy array, else a zero-copy cupy view through __cuda_array_interface__."""
    import cupy
    return x if isinstance(x, cupy.ndarray) else cupy.asarray(x)


_comm_streams = {}     # device id -> cupy.cuda.Stream


def comm_stream():
    """The communication stream of the bound device (created once; non-blocking so it never serialises with
    the legacy default stream)."""
    import cupy
    device = bound_device()
    stream = _comm_streams.get(device)
    if stream is None:
        with _lock:
            stream = _comm_streams.get(device)
            if stream is None:
                with cupy.cuda.Device(device):
                    stream = _comm_streams[device] = cupy.cuda.Stream(non_blocking=True)
    return stream


def enter_comm_stream():
    """Make the bound device and its comm stream current in the calling thread (both are thread-local in
    CUDA/cupy, so the engine thread must do this itself); return the stream."""
    import cupy
    cupy.cuda.Device(bound_device()).use()
    stream = comm_stream()
    stream.use()
    return stream


def drain(stream, spin_s):
    """Return once everything queued on stream so far has finished: the transports' own syncs (their streams
    hold only local kernels and copies, so they always drain). Polls for up to spin_s, then sleeps in a
    blocking-sync event: a small collective's copies and kernels finish in microseconds, and waking from the
    sleep cost more than that (mpi_staged at 64 KB: 299 us per call sleeping at once, 150 us polling first, on an
    H200 host), while long kernels still leave the core free."""
    import cupy
    event = cupy.cuda.Event(block=True, disable_timing=True)
    event.record(stream)
    wait_for_event(event, spin_s)


def wait_for_event(event, spin_s, clock=time.perf_counter):
    """event.done polled until spin_s has passed, then event.synchronize() (cupy's query releases the GIL)."""
    if spin_s > 0:
        deadline = clock() + spin_s
        while clock() < deadline:
            if event.done:
                return
    event.synchronize()


class DeviceOps:
    """fusion.HostOps for cupy arrays: the same methods, run on the comm stream with ringtrain's kernels."""

    device = "cuda"

    def __init__(self):
        import cupy
        from . import kernels
        self._cupy = cupy
        self._kernels = kernels

    def pack(self, srcs, staging):
        """Copy each flat source into consecutive slices of staging in one launch; an int n zero-fills n elements
        (a joined rank's contribution)."""
        stream = enter_comm_stream()
        offset, pairs = 0, []
        for src in srcs:
            if isinstance(src, int):
                staging[offset:offset + src].fill(0)
                offset += src
            else:
                src = as_cupy(src).reshape(-1)
                pairs.append((staging[offset:offset + src.size], src))
                offset += src.size
        self._copy_pairs(pairs, 1.0, stream)
        return offset

    def unpack(self, staging, dsts, scale=1.0):
        """Copy consecutive slices of staging into each flat destination times scale, in one launch
        (an int n skips n elements)."""
        stream = enter_comm_stream()
        offset, pairs = 0, []
        for dst in dsts:
            if isinstance(dst, int):
                offset += dst
                continue
            dst = as_cupy(dst).reshape(-1)
            pairs.append((dst, staging[offset:offset + dst.size]))
            offset += dst.size
        self._copy_pairs(pairs, scale, stream)

    def _copy_pairs(self, pairs, scale, stream):
        if scale == 1.0:
            self._kernels.batched_copy(pairs, stream)
        else:
            self._kernels.batched_scale(pairs, scale, stream)

    def scale(self, buf, factor):
        stream = enter_comm_stream()
        self._kernels.batched_scale([(buf, buf)], factor, stream)

    def empty(self, shape, dtype):
        with self._cupy.cuda.Device(bound_device()):
            return self._cupy.empty(shape, dtype=dtype)

    def zeros(self, shape, dtype):
        with self._cupy.cuda.Device(bound_device()):
            return self._cupy.zeros(shape, dtype=dtype)

    def copy(self, array):
        """A contiguous copy, ordered on the calling thread's current stream (the caller's at submit time,
        the comm stream on the engine thread)."""
        with self._cupy.cuda.Device(bound_device()):
            return self._cupy.array(as_cupy(array), copy=True, order="C")

    def ready_event(self):
        """Called on the submitting thread: an event on its current stream marking the input as written."""
        event = self._cupy.cuda.Event(block=False, disable_timing=True)
        event.record(self._cupy.cuda.get_current_stream())
        return event

    def wait_event(self, event):
        """Called on the engine thread: the comm stream waits (on the GPU) for the producer's event."""
        stream = enter_comm_stream()
        if event is not None:
            stream.wait_event(event)

    def done_event(self):
        """Called on the engine thread after unpacking: Handle.wait() synchronises just this event."""
        stream = enter_comm_stream()
        # block=True: the waiting host thread sleeps in cudaEventSynchronize instead of spinning a core
        event = self._cupy.cuda.Event(block=True, disable_timing=True)
        event.record(stream)
        return CompletionEvent(event)


class CompletionEvent:
    """What Handle keeps for a device result: query() (non-blocking, for poll) and synchronize()
    (cupy's Event spells the first `.done`)."""
    __slots__ = ("event",)

    def __init__(self, event):
        self.event = event

    def query(self):
        return self.event.done

    def synchronize(self):
        self.event.synchronize()


def device_ops():
    """The process-wide DeviceOps (compiles nothing until a kernel is first launched)."""
    global _device_ops
    if _device_ops is None:
        with _lock:
            if _device_ops is None:
                _device_ops = DeviceOps()
    return _device_ops


class GrowingBuffer:
    """A reusable 1-D uint8 device buffer; get(n) returns its first n bytes, reallocating only to grow.
    Transports keep staging and receive scratch in these so a training step allocates nothing."""

    def __init__(self):
        self._array = None

    def get(self, nbytes):
        if self._array is None or self._array.nbytes < nbytes:
            import cupy
            with cupy.cuda.Device(bound_device()):
                self._array = cupy.empty(max(int(nbytes), 1), dtype=cupy.uint8)
        return self._array[:nbytes]

    def release(self):
        self._array = None
