/* The compiled express cycle's context, shared by its two sources (one extension module, _express_cycle):
 * express_cycle.c (one agreement cycle on the shared-memory window: rt_express, and the module) and express_fast.c
 * (a planned allreduce's whole express call, with the state Python keeps for it -- cycle number, stats, flight-
 * recorder entries, rank 0's LRU uses -- held here while the ctx is armed). ringtrain/engine/native_cycle.py builds
 * them together and ringtrain/engine/fast_state.py owns the armed state's Python side. express_group.c, in the
 * same module, describes a binding's group in one call. */
#ifndef RT_EXPRESS_CTX_H
#define RT_EXPRESS_CTX_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <time.h>

#define RT_NOT_YET 0
#define RT_DONE 1
#define RT_ARRIVED 2
#define CAPSULE "ringtrain.express_cycle.ctx"
#define RT_ARMED 1                     /* ctx->armed: fast() takes any planned call */
#define RT_ARMED_HELD 2                /* ... only the held-back async call's wait (fast_hold) */
#define FAST_RING 4096                 /* fast calls between two drains at most (then fast() declines) */
#define RT_HIDDEN __attribute__((visibility("hidden")))

typedef struct { int64_t cycle, cid, nbytes, start_ns, end_ns; } rt_fast_entry;

typedef struct {
    int rank, size;
    int64_t header_bytes;          /* where a slot's eager data begins */
    int64_t bitmap_offset;         /* where a slot's bitmap words begin */
    int64_t *published[256];
    char *slots[256][2];
    /* the planned call's state (express_fast.c): Python arms it when its own agreement state is idle, and disarms
     * and drains it (reading back what the fast calls did) before anything else touches that state */
    int64_t armed, cycle, generation, words, spin_ns, stub;
    int64_t unresolved, unresolved_cid;    /* a cycle fast() published and left to its caller to finish (0: none) */
    int64_t count, nbytes_total, ns_total, last_end_ns, seq, drained;
    rt_fast_entry ring[FAST_RING];         /* every fast call since the last drain, in call order */
} rt_ctx;

/* CLOCK_MONOTONIC: the clock of Python's time.perf_counter on Linux (fast_state.py checks that it is) */
static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

RT_HIDDEN int rt_express(void *handle, int64_t c, int64_t flags, int64_t cid, int64_t words, const void *src,
                         int64_t nbytes, void *out, int kind, double scale, int64_t divisor, int64_t spin_ns);
RT_HIDDEN PyObject *py_fast(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
RT_HIDDEN PyObject *py_fast_hold(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
RT_HIDDEN PyObject *py_fast_arm(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
RT_HIDDEN PyObject *py_fast_disarm(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
RT_HIDDEN PyObject *py_fast_resolved(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
RT_HIDDEN PyObject *py_clock_ns(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
RT_HIDDEN PyObject *py_fast_record(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
RT_HIDDEN PyObject *py_fast_durations(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
RT_HIDDEN PyObject *py_read_group(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
#endif
