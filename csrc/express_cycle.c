/* One express agreement cycle on the shared-memory window, in compiled code: a tiny CPython extension module
 * (ringtrain/engine/native_cycle.py builds and loads it, and argues the memory ordering; cycle_exchange.py describes
 * the window's layout). An extension rather than ctypes: a call takes its arrays through the buffer protocol
 * (~0.1 us each), where ctypes needs each array's address from Python (__array_interface__, ~1-2 us each).
 *
 * express(ctx, c, flags, cid, words, src, out, kind, scale, divisor, spin_ns) -> int
 *   fill this rank's slot of parity c % 2 (header [c, flags, cid, nbytes], the bitmap with bit cid alone, the
 *   eager data), release-store c into this rank's published word, then spin (bounded by spin_ns) until every
 *   peer's published word is >= c (acquire loads). Returns
 *     RT_NOT_YET  (0)  some peer has not published c yet: the caller waits (the Python Watchdog) and decides;
 *     RT_DONE     (1)  every rank published c with flags 0, bit cid set and the same eager (cid, nbytes): the
 *                      slots were reduced in rank order into out (and scaled);
 *     RT_ARRIVED  (2)  every rank published c, but the snapshot is not that one (or kind < 0: no native reduce):
 *                      the caller reads the slots and decides, exactly as after its own gather.
 *   The slot and published word are written in every outcome, so the caller never publishes again.
 *   src None: cycle c was published by an earlier call that returned NOT_YET: only the bounded wait and the
 *   outcome (out's length is the eager nbytes) -- the caller's wait in short native rounds (NativeCycle.resume).
 *
 * pack_group(members, sizes, out)
 *   a small group's members (each a C-contiguous buffer, or an int address of sizes[i] bytes) copied back to back
 *   into out, one fresh packed buffer of the group's total size, which is then reduced as any array is.
 *
 * fast, fast_arm, fast_hold, fast_disarm, fast_resolved, clock_ns: a planned call's whole express call (express_fast.c).
 */
#include "express_ctx.h"
#include <stdlib.h>
#include <string.h>
#include <sched.h>

/* kind: dtype * 2 + (1 when the result is scaled); dtypes: */
enum { F32 = 0, F64 = 1, I32 = 2, I64 = 3 };

static void *rt_ctx_new(int rank, int size, int64_t header_bytes, int64_t bitmap_offset, const int64_t *published,
                        const int64_t *slots) {
    if (size < 1 || size > 256) return NULL;
    rt_ctx *ctx = (rt_ctx *)calloc(1, sizeof(rt_ctx));
    if (!ctx) return NULL;
    ctx->rank = rank;
    ctx->size = size;
    ctx->header_bytes = header_bytes;
    ctx->bitmap_offset = bitmap_offset;
    for (int p = 0; p < size; p++) {
        ctx->published[p] = (int64_t *)(intptr_t)published[p];
        ctx->slots[p][0] = (char *)(intptr_t)slots[2 * p];
        ctx->slots[p][1] = (char *)(intptr_t)slots[2 * p + 1];
    }
    return ctx;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Sum the slots' data in rank order into out: out = s0 + s1, then out += s2, ... (numpy's add does the same
 * adds element by element: bitwise the same result). Integers add modulo 2^n as numpy does. */
#define SUM_LOOP(T, U)                                                                         \
    {                                                                                          \
        T *o = (T *)out;                                                                       \
        const T *a = (const T *)data[0], *b = (const T *)data[1];                              \
        for (int64_t i = 0; i < n; i++) o[i] = (T)((U)a[i] + (U)b[i]);                         \
        for (int p = 2; p < size; p++) {                                                      \
            const T *s = (const T *)data[p];                                                   \
            for (int64_t i = 0; i < n; i++) o[i] = (T)((U)o[i] + (U)s[i]);                     \
        }                                                                                      \
    }

/* Integers divide by the rank count rounding toward zero (C's division): ringtrain.ops.truncating_divide. */
#define DIVIDE_LOOP(T)                                                                         \
    {                                                                                          \
        T *o = (T *)out;                                                                       \
        for (int64_t i = 0; i < n; i++) o[i] = (T)(o[i] / (T)divisor);                         \
    }

static void reduce(int kind, int size, char **data, void *out, int64_t nbytes, double scale, int64_t divisor) {
    int dtype = kind >> 1, scaled = kind & 1;
    switch (dtype) {
    case F32: {
        int64_t n = nbytes / 4;
        SUM_LOOP(float, float)
        if (scaled) {
            float f = (float)scale, *o = (float *)out;
            for (int64_t i = 0; i < n; i++) o[i] = o[i] * f;
        }
        break;
    }
    case F64: {
        int64_t n = nbytes / 8;
        SUM_LOOP(double, double)
        if (scaled) {
            double *o = (double *)out;
            for (int64_t i = 0; i < n; i++) o[i] = o[i] * scale;
        }
        break;
    }
    case I32: {
        int64_t n = nbytes / 4;
        SUM_LOOP(int32_t, uint32_t)
        if (scaled) DIVIDE_LOOP(int32_t)
        break;
    }
    case I64: {
        int64_t n = nbytes / 8;
        SUM_LOOP(int64_t, uint64_t)
        if (scaled) DIVIDE_LOOP(int64_t)
        break;
    }
    }
}

RT_HIDDEN int rt_express(void *handle, int64_t c, int64_t flags, int64_t cid, int64_t words, const void *src, int64_t nbytes,
               void *out, int kind, double scale, int64_t divisor, int64_t spin_ns) {
    rt_ctx *ctx = (rt_ctx *)handle;
    const int rank = ctx->rank, size = ctx->size, parity = (int)(c & 1);
    const int64_t word = cid >> 6;
    const uint64_t bit = (uint64_t)1 << (cid & 63);

    if (src) {     /* NULL: cycle c is published already (an earlier call's NOT_YET): wait and reduce only */
        /* our slot: header, bitmap, eager data */
        char *mine = ctx->slots[rank][parity];
        int64_t *header = (int64_t *)mine;
        header[0] = c;
        header[1] = flags;
        header[2] = cid;
        header[3] = nbytes;
        uint64_t *bitmap = (uint64_t *)(mine + ctx->bitmap_offset);
        for (int64_t w = 0; w < words; w++) bitmap[w] = w == word ? bit : 0;
        if (nbytes) memcpy(mine + ctx->header_bytes, src, (size_t)nbytes);
        /* publish: every store above happens-before a peer's acquire load that reads c */
        __atomic_store_n(ctx->published[rank], c, __ATOMIC_RELEASE);
    }

    /* wait, bounded, for every peer's cycle c */
    int64_t deadline = 0;
    for (int p = 0, spins = 0; p < size;) {
        if (p == rank || __atomic_load_n(ctx->published[p], __ATOMIC_ACQUIRE) >= c) {
            p++;
            continue;
        }
        if (++spins < 64) {
            cpu_relax();
            continue;
        }
        int64_t t = now_ns();
        if (deadline == 0) deadline = t + spin_ns;
        else if (t > deadline) return RT_NOT_YET;
        sched_yield();             /* on an oversubscribed node the peer may need this very core */
    }

    /* every rank published c: the fast outcome needs no flag, our bit everywhere, our eager header everywhere */
    if (kind < 0 || flags) return RT_ARRIVED;
    char *data[256];
    for (int p = 0; p < size; p++) {
        const char *slot = ctx->slots[p][parity];
        const int64_t *h = (const int64_t *)slot;
        const uint64_t *b = (const uint64_t *)(slot + ctx->bitmap_offset);
        if (h[1] != 0 || !(b[word] & bit) || h[2] != cid || h[3] != nbytes) return RT_ARRIVED;
        data[p] = (char *)slot + ctx->header_bytes;
    }
    reduce(kind, size, data, out, nbytes, scale, divisor);
    return RT_DONE;
}

/* ---- the Python module ------------------------------------------------------------------------------------- */
static void capsule_free(PyObject *capsule) { free(PyCapsule_GetPointer(capsule, CAPSULE)); }

/* ctx_new(rank, size, header_bytes, bitmap_offset, published addresses (tuple), slot addresses (tuple, 2 a rank)) */
static PyObject *py_ctx_new(PyObject *self, PyObject *args) {
    int rank, size;
    long long header_bytes, bitmap_offset;
    PyObject *published, *slots;
    if (!PyArg_ParseTuple(args, "iiLLO!O!", &rank, &size, &header_bytes, &bitmap_offset, &PyTuple_Type, &published,
                          &PyTuple_Type, &slots))
        return NULL;
    if (size < 1 || size > 256 || PyTuple_GET_SIZE(published) != size || PyTuple_GET_SIZE(slots) != 2 * size) {
        PyErr_Format(PyExc_ValueError, "express_cycle.ctx_new: %d ranks need %d published and %d slot addresses "
                     "(at most 256 ranks)", size, size, 2 * size);
        return NULL;
    }
    int64_t pub[256], sl[512];
    for (int p = 0; p < size; p++) pub[p] = PyLong_AsLongLong(PyTuple_GET_ITEM(published, p));
    for (int p = 0; p < 2 * size; p++) sl[p] = PyLong_AsLongLong(PyTuple_GET_ITEM(slots, p));
    if (PyErr_Occurred()) return NULL;
    void *ctx = rt_ctx_new(rank, size, header_bytes, bitmap_offset, pub, sl);
    if (!ctx) return PyErr_NoMemory();
    return PyCapsule_New(ctx, CAPSULE, capsule_free);
}

/* express(ctx, c, flags, cid, words, src, out, kind, scale, divisor, spin_ns) -> outcome */
static PyObject *py_express(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 11) {
        PyErr_SetString(PyExc_TypeError, "express_cycle.express takes 11 arguments");
        return NULL;
    }
    void *ctx = PyCapsule_GetPointer(args[0], CAPSULE);
    if (!ctx) return NULL;
    long long c = PyLong_AsLongLong(args[1]), flags = PyLong_AsLongLong(args[2]), cid = PyLong_AsLongLong(args[3]),
              words = PyLong_AsLongLong(args[4]), divisor = PyLong_AsLongLong(args[9]),
              spin_ns = PyLong_AsLongLong(args[10]);
    long kind = PyLong_AsLong(args[7]);
    double scale = PyFloat_AsDouble(args[8]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer src, out;
    const int resume = args[5] == Py_None;     /* see rt_express: cycle c is ours already, `out` gives nbytes */
    if (!resume && PyObject_GetBuffer(args[5], &src, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(args[6], &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        if (!resume) PyBuffer_Release(&src);
        return NULL;
    }
    if (resume) {
        src.buf = NULL;
        src.len = out.len;
    }
    int outcome;
    if (out.len != src.len) {
        PyErr_Format(PyExc_ValueError, "express_cycle.express: out has %zd bytes, the input %zd", out.len, src.len);
        outcome = -1;
    } else if (resume) {
        /* a wait of up to spin_ns on a published cycle: other threads run meanwhile. Only the holder of the engine's
         * progress lock finishes a published cycle (the compiled call's ctx is disarmed until then) */
        Py_BEGIN_ALLOW_THREADS
        outcome = rt_express(ctx, c, flags, cid, words, NULL, src.len, out.buf, (int)kind, scale, divisor, spin_ns);
        Py_END_ALLOW_THREADS
    } else {
        outcome = rt_express(ctx, c, flags, cid, words, src.buf, src.len, out.buf, (int)kind, scale, divisor,
                             spin_ns);
    }
    PyBuffer_Release(&out);
    if (!resume) PyBuffer_Release(&src);
    if (outcome < 0) return NULL;
    return PyLong_FromLong(outcome);
}

/* A small group's members copied back to back into dst (capacity bytes): the bytes copied, or -1 with an exception
 * set. A member is a buffer (its length must be sizes[i]) or an int address the caller vouches for (sizes[i]
 * readable bytes: a torch tensor's data_ptr, checked contiguous and on the CPU). */
static int64_t copy_members(PyObject *members, PyObject *sizes, char *dst, int64_t capacity) {
    if (!PyTuple_Check(members) || !PyTuple_Check(sizes) || PyTuple_GET_SIZE(members) != PyTuple_GET_SIZE(sizes)) {
        PyErr_SetString(PyExc_TypeError, "express_cycle: a group's members and sizes must be tuples of one length");
        return -1;
    }
    int64_t filled = 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(members); i++) {
        PyObject *member = PyTuple_GET_ITEM(members, i);
        long long want = PyLong_AsLongLong(PyTuple_GET_ITEM(sizes, i));
        if (PyErr_Occurred()) return -1;
        if (want < 0 || filled + want > capacity) {
            PyErr_Format(PyExc_ValueError, "express_cycle: group member %zd's %lld bytes overrun the %lld of out", i,
                         want, (long long)capacity);
            return -1;
        }
        if (PyLong_Check(member)) {
            const void *from = PyLong_AsVoidPtr(member);
            if (PyErr_Occurred()) return -1;
            if (want) memcpy(dst + filled, from, (size_t)want);
        } else {
            Py_buffer in;
            if (PyObject_GetBuffer(member, &in, PyBUF_C_CONTIGUOUS) < 0) return -1;
            if (in.len != want) {
                PyErr_Format(PyExc_ValueError, "express_cycle: group member %zd has %zd bytes, expected %lld", i,
                             in.len, want);
                PyBuffer_Release(&in);
                return -1;
            }
            if (want) memcpy(dst + filled, in.buf, (size_t)want);
            PyBuffer_Release(&in);
        }
        filled += want;
    }
    if (filled != capacity) {
        PyErr_Format(PyExc_ValueError, "express_cycle: the group's members have %lld bytes, out %lld",
                     (long long)filled, (long long)capacity);
        return -1;
    }
    return filled;
}

/* pack_group(members, sizes, out): see the head */
static PyObject *py_pack_group(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "express_cycle.pack_group takes 3 arguments");
        return NULL;
    }
    Py_buffer out;
    if (PyObject_GetBuffer(args[2], &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) return NULL;
    int64_t nbytes = copy_members(args[0], args[1], (char *)out.buf, (int64_t)out.len);
    PyBuffer_Release(&out);
    if (nbytes < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_nothing(PyObject *self, PyObject *const *args, Py_ssize_t nargs) { Py_RETURN_NONE; }

static PyMethodDef methods[] = {
    {"ctx_new", py_ctx_new, METH_VARARGS, "the context of one rank's window: a capsule"},
    {"express", (PyCFunction)(void (*)(void))py_express, METH_FASTCALL, "one express cycle (see the file's head)"},
    {"pack_group", (PyCFunction)(void (*)(void))py_pack_group, METH_FASTCALL,
     "a group's members back to back into one buffer"},
    {"fast", (PyCFunction)(void (*)(void))py_fast, METH_FASTCALL, "a planned express call whole (express_fast.c)"},
    {"fast_arm", (PyCFunction)(void (*)(void))py_fast_arm, METH_FASTCALL, "arm the planned call's state"},
    {"fast_hold", (PyCFunction)(void (*)(void))py_fast_hold, METH_FASTCALL, "armed for a held-back call's wait"},
    {"fast_disarm", (PyCFunction)(void (*)(void))py_fast_disarm, METH_FASTCALL, "disarm (and drain) it"},
    {"fast_resolved", (PyCFunction)(void (*)(void))py_fast_resolved, METH_FASTCALL, "an unresolved cycle is done"},
    {"clock_ns", (PyCFunction)(void (*)(void))py_clock_ns, METH_FASTCALL, "the ctx's clock (CLOCK_MONOTONIC), ns"},
    {"fast_record", (PyCFunction)(void (*)(void))py_fast_record, METH_FASTCALL,
     "drained calls into the flight recorder's ring"},
    {"fast_durations", (PyCFunction)(void (*)(void))py_fast_durations, METH_FASTCALL, "drained calls' durations, s"},
    {"nothing", (PyCFunction)(void (*)(void))py_nothing, METH_FASTCALL, "no work: what a call alone costs"},
    {"read_group", (PyCFunction)(void (*)(void))py_read_group, METH_FASTCALL,
     "a group's signature and addresses (express_group.c)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_express_cycle", NULL, -1, methods};

PyMODINIT_FUNC PyInit__express_cycle(void) { return PyModule_Create(&module); }
