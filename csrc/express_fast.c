/* A planned allreduce's whole express call in one C call, and the state Python keeps for it, held in the ctx while
 * it is armed (ringtrain/engine/fast_state.py is the Python side; express_ctx.h the shared context).
 *
 * fast(rec, array, out[, held]) -> True | None | 0 | 2
 *   rec = (fast, ctx, generation, cid, kind, scale, divisor): a plan's record (CycleAgreement._read_plan).
 *   held (any object): this call is the wait of the held-back async allreduce fast_hold() left the ctx armed for;
 *   it runs only in that state, and once done the ctx takes any planned call again.
 *   None: nothing done -- the ctx is not armed (for this kind of call), the record's generation (the cache's
 *   update count when it was read) is not the ctx's, FAST_RING calls wait to be drained, or a buffer is not
 *   C-contiguous (out: writable) or the two lengths differ. The caller goes the Python way, which drains first.
 *   True: cycle cycle + 1 ran as rt_express with flags 0 and reduced the call into out; the cycle number, the
 *   counts and the call's ring entry (cid, start, end) stay here until the next drain.
 *   0 / 2 (RT_NOT_YET / RT_ARRIVED): that cycle is published but not finished. The ctx disarms itself and keeps it
 *   as `unresolved`; the caller must finish it in Python (Engine.express(..., resumed=outcome)), and until it does
 *   no pass runs (a cycle left unresolved past the stall timeout fails the engine naming it).
 * fast_arm(ctx, cycle, generation, words, spin_ns, stub) -> bool: arm from Python's state (False: a cycle is
 *   unresolved). stub: skip the window (DONE at once; a harness's switch for timing the Python around the call).
 * fast_hold(ctx) -> bool: an async allreduce is held back (HeldCalls.hold, held.py): an armed ctx stays armed for
 *   that call's wait alone (fast(..., held)); other calls decline until then. False: not armed.
 * fast_disarm(ctx) -> None (nothing to drain) or (cycle, unresolved, unresolved_cid, last_end_ns, count, nbytes,
 *   ns, cids, starts_ns, ends_ns): disarm and drain, the lists in call order. fast_disarm(ctx, 0): disarm only (any
 *   thread; the GIL makes every function here atomic with respect to Python threads).
 * fast_resolved(ctx): the unresolved cycle is finished.  clock_ns(): the clock of every time here, in ns. */
#include "express_ctx.h"

PyObject *py_fast(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if ((nargs != 3 && nargs != 4) || !PyTuple_CheckExact(args[0]) || PyTuple_GET_SIZE(args[0]) != 7) {
        PyErr_SetString(PyExc_TypeError, "express_cycle.fast takes (record, array, out[, held])");
        return NULL;
    }
    PyObject *rec = args[0];
    rt_ctx *ctx = (rt_ctx *)PyCapsule_GetPointer(PyTuple_GET_ITEM(rec, 1), CAPSULE);
    if (!ctx) return NULL;
    if (ctx->armed != (nargs == 4 ? RT_ARMED_HELD : RT_ARMED) || ctx->seq - ctx->drained >= FAST_RING) Py_RETURN_NONE;
    if (PyLong_AsLongLong(PyTuple_GET_ITEM(rec, 2)) != ctx->generation) Py_RETURN_NONE;
    long long cid = PyLong_AsLongLong(PyTuple_GET_ITEM(rec, 3)), divisor = PyLong_AsLongLong(PyTuple_GET_ITEM(rec, 6));
    long kind = PyLong_AsLong(PyTuple_GET_ITEM(rec, 4));
    double scale = PyFloat_AsDouble(PyTuple_GET_ITEM(rec, 5));
    if (PyErr_Occurred()) return NULL;
    Py_buffer src, out;
    if (PyObject_GetBuffer(args[1], &src, PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    int same = args[2] == args[1];
    if (!same && PyObject_GetBuffer(args[2], &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyErr_Clear();
        PyBuffer_Release(&src);
        Py_RETURN_NONE;
    }
    if (same) out = src;
    if (out.len != src.len || src.len == 0 || (same && src.readonly)) {
        if (!same) PyBuffer_Release(&out);
        PyBuffer_Release(&src);
        Py_RETURN_NONE;
    }
    int64_t start = now_ns(), c = ctx->cycle + 1;
    int outcome = ctx->stub ? RT_DONE : rt_express(ctx, c, 0, cid, ctx->words, src.buf, src.len, out.buf, (int)kind,
                                                   scale, divisor, ctx->spin_ns);
    int64_t nbytes = src.len;
    if (!same) PyBuffer_Release(&out);
    PyBuffer_Release(&src);
    if (outcome != RT_DONE) {
        ctx->armed = 0;
        ctx->unresolved = c;
        ctx->unresolved_cid = cid;
        return PyLong_FromLong(outcome);
    }
    int64_t end = now_ns();
    ctx->armed = RT_ARMED;
    ctx->cycle = c;
    ctx->count++;
    ctx->nbytes_total += nbytes;
    ctx->ns_total += end - start;
    ctx->last_end_ns = end;
    rt_fast_entry *e = &ctx->ring[ctx->seq++ & (FAST_RING - 1)];
    e->cycle = c;
    e->cid = cid;
    e->nbytes = nbytes;
    e->start_ns = start;
    e->end_ns = end;
    Py_RETURN_TRUE;
}

PyObject *py_fast_arm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "express_cycle.fast_arm takes 6 arguments");
        return NULL;
    }
    rt_ctx *ctx = (rt_ctx *)PyCapsule_GetPointer(args[0], CAPSULE);
    if (!ctx) return NULL;
    int64_t v[5];
    for (int k = 0; k < 5; k++) v[k] = PyLong_AsLongLong(args[k + 1]);
    if (PyErr_Occurred()) return NULL;
    if (ctx->unresolved) Py_RETURN_FALSE;
    ctx->cycle = v[0];
    ctx->generation = v[1];
    ctx->words = v[2];
    ctx->spin_ns = v[3];
    ctx->stub = v[4];
    ctx->armed = RT_ARMED;
    Py_RETURN_TRUE;
}

PyObject *py_fast_hold(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    rt_ctx *ctx = nargs == 1 ? (rt_ctx *)PyCapsule_GetPointer(args[0], CAPSULE) : NULL;
    if (!ctx) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "express_cycle.fast_hold takes the ctx");
        return NULL;
    }
    if (ctx->armed != RT_ARMED) Py_RETURN_FALSE;
    ctx->armed = RT_ARMED_HELD;
    Py_RETURN_TRUE;
}

static PyObject *int_list(int64_t first, int64_t last, const rt_ctx *ctx, int field) {
    PyObject *list = PyList_New((Py_ssize_t)(last - first));
    if (!list) return NULL;
    for (int64_t s = first; s < last; s++) {
        const rt_fast_entry *e = &ctx->ring[s & (FAST_RING - 1)];
        PyObject *v = PyLong_FromLongLong(field == 0 ? e->cid : field == 1 ? e->start_ns : e->end_ns);
        if (!v) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)(s - first), v);
    }
    return list;
}

PyObject *py_fast_disarm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 1 && nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "express_cycle.fast_disarm takes 1 or 2 arguments");
        return NULL;
    }
    rt_ctx *ctx = (rt_ctx *)PyCapsule_GetPointer(args[0], CAPSULE);
    if (!ctx) return NULL;
    int was = (int)ctx->armed;
    ctx->armed = 0;
    if (nargs == 2) Py_RETURN_NONE;       /* disarm only: the drain waits for a holder of the progress lock */
    if (!was && !ctx->count && !ctx->unresolved) Py_RETURN_NONE;
    /* the ring never wraps between drains (fast() declines when full): first is where this drain starts */
    int64_t first = ctx->seq - ctx->drained > FAST_RING ? ctx->seq - FAST_RING : ctx->drained;
    PyObject *cids = int_list(first, ctx->seq, ctx, 0), *starts = int_list(first, ctx->seq, ctx, 1),
             *ends = int_list(first, ctx->seq, ctx, 2);
    if (!cids || !starts || !ends) {
        Py_XDECREF(cids);
        Py_XDECREF(starts);
        Py_XDECREF(ends);
        return NULL;
    }
    PyObject *r = Py_BuildValue("(LLLLLLLNNN)", (long long)ctx->cycle, (long long)ctx->unresolved,
                                (long long)ctx->unresolved_cid, (long long)ctx->last_end_ns, (long long)ctx->count,
                                (long long)ctx->nbytes_total, (long long)ctx->ns_total, cids, starts, ends);
    if (!r) return NULL;
    ctx->count = ctx->nbytes_total = ctx->ns_total = 0;
    ctx->drained = ctx->seq;
    return r;
}

PyObject *py_fast_resolved(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    rt_ctx *ctx = nargs == 1 ? (rt_ctx *)PyCapsule_GetPointer(args[0], CAPSULE) : NULL;
    if (!ctx) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "express_cycle.fast_resolved takes the ctx");
        return NULL;
    }
    ctx->unresolved = ctx->unresolved_cid = 0;
    Py_RETURN_NONE;
}

PyObject *py_clock_ns(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return PyLong_FromLongLong(now_ns());
}

/* The drain's per-call bookkeeping (fast_state.py's _book), which in Python costs more than a small call itself:
 * fast_record(ring, seq, keys, cids, starts_ns, ends_ns) -> the last seq written: call k becomes the flight
 *   recorder's entry ring[s & (len(ring) - 1)] = [s, name, meta, start_ns * 1e-9, None, end_ns * 1e-9, None] with
 *   s = seq + 1 + k and (name, meta) = keys[cids[k]] (flight_recorder.FlightRecorder.add_finished's loop);
 * fast_durations(starts_ns, ends_ns) -> [(end - start) * 1e-9 for each call]: the stats' samples. */
PyObject *py_fast_record(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6 || !PyList_CheckExact(args[0]) || !PyDict_Check(args[2]) || !PyList_CheckExact(args[3]) ||
        !PyList_CheckExact(args[4]) || !PyList_CheckExact(args[5])) {
        PyErr_SetString(PyExc_TypeError, "express_cycle.fast_record takes (ring, seq, keys, cids, starts, ends)");
        return NULL;
    }
    PyObject *ring = args[0], *keys = args[2], *cids = args[3], *starts = args[4], *ends = args[5];
    Py_ssize_t size = PyList_GET_SIZE(ring), n = PyList_GET_SIZE(cids);
    if (size == 0 || (size & (size - 1)) || PyList_GET_SIZE(starts) != n || PyList_GET_SIZE(ends) != n) {
        PyErr_SetString(PyExc_ValueError, "express_cycle.fast_record: the ring's length must be a power of two and "
                        "cids, starts and ends of one length");
        return NULL;
    }
    long long seq = PyLong_AsLongLong(args[1]);
    if (seq == -1 && PyErr_Occurred()) return NULL;
    for (Py_ssize_t k = 0; k < n; k++) {
        if (PyList_GET_SIZE(ring) != size || PyList_GET_SIZE(cids) != n || PyList_GET_SIZE(starts) != n ||
            PyList_GET_SIZE(ends) != n) {
            PyErr_SetString(PyExc_RuntimeError, "express_cycle.fast_record: a list changed while it was written");
            return NULL;
        }
        PyObject *cid = PyList_GET_ITEM(cids, k);
        PyObject *key = PyDict_GetItemWithError(keys, cid);        /* borrowed */
        if (!key) {
            if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, cid);
            return NULL;
        }
        if (!(PyTuple_Check(key) || PyList_Check(key)) || PySequence_Fast_GET_SIZE(key) != 2) {
            PyErr_SetString(PyExc_TypeError, "express_cycle.fast_record: a key is not a (name, meta) pair");
            return NULL;
        }
        PyObject **pair = PySequence_Fast_ITEMS(key);
        long long start = PyLong_AsLongLong(PyList_GET_ITEM(starts, k)),
                  end = PyLong_AsLongLong(PyList_GET_ITEM(ends, k));
        if (PyErr_Occurred()) return NULL;
        seq += 1;
        PyObject *entry = PyList_New(7), *number = PyLong_FromLongLong(seq),
                 *started = PyFloat_FromDouble((double)start * 1e-9),
                 *finished = PyFloat_FromDouble((double)end * 1e-9);
        if (!entry || !number || !started || !finished) {
            Py_XDECREF(entry);
            Py_XDECREF(number);
            Py_XDECREF(started);
            Py_XDECREF(finished);
            return NULL;
        }
        PyList_SET_ITEM(entry, 0, number);
        PyList_SET_ITEM(entry, 1, Py_NewRef(pair[0]));
        PyList_SET_ITEM(entry, 2, Py_NewRef(pair[1]));
        PyList_SET_ITEM(entry, 3, started);
        PyList_SET_ITEM(entry, 4, Py_NewRef(Py_None));
        PyList_SET_ITEM(entry, 5, finished);
        PyList_SET_ITEM(entry, 6, Py_NewRef(Py_None));
        if (PyList_SetItem(ring, (Py_ssize_t)(seq & (size - 1)), entry) < 0) return NULL;     /* (steals entry) */
    }
    return PyLong_FromLongLong(seq);
}

PyObject *py_fast_durations(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyList_CheckExact(args[0]) || !PyList_CheckExact(args[1]) ||
        PyList_GET_SIZE(args[0]) != PyList_GET_SIZE(args[1])) {
        PyErr_SetString(PyExc_TypeError, "express_cycle.fast_durations takes two lists of one length");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(args[0]);
    PyObject *out = PyList_New(n);
    if (!out) return NULL;
    for (Py_ssize_t k = 0; k < n; k++) {
        long long start = PyLong_AsLongLong(PyList_GET_ITEM(args[0], k)),
                  end = PyLong_AsLongLong(PyList_GET_ITEM(args[1], k));
        PyObject *v = PyErr_Occurred() ? NULL : PyFloat_FromDouble((double)(end - start) * 1e-9);
        if (!v) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, k, v);
    }
    return out;
}
