/* Writes that bypass the caches: a tiny CPython extension module (ringtrain/stream_copy.py builds and loads it).
 *
 * copy(dst, src) -> None
 *   dst <- src, byte for byte (the buffers: C-contiguous, the same number of bytes, dst writable). On x86-64 the
 *   stores are non-temporal (vmovntdq): a line of dst is written to memory without first being read into the cache
 *   (the "write-allocate" read every ordinary store to an uncached line pays) and without evicting what the caches
 *   hold. That is a third less memory traffic when dst is memory the process has not touched lately -- a fresh
 *   result array -- and the wrong tool when dst is about to be read again (it has left the caches). The head up to
 *   dst's first 32-byte boundary and the tail are ordinary stores; an sfence at the end orders the non-temporal
 *   stores before any later store (a flag a peer polls). Only on CPUs with AVX (32-byte stores; see below);
 *   elsewhere memcpy, and streams() says False. The GIL is released while copying.
 *
 * reduce_push(kind, dst, own, regions, scale) -> None
 *   The shared-memory transport's step for its own block, in one pass: acc = own + regions[0] + regions[1] + ...
 *   (element by element, in that order), times scale unless scale is 1, then acc is stored into every buffer of
 *   `regions` (ordinary stores: peers read them next) and streamed into dst (non-temporal stores). kind: 0 float32,
 *   1 float64. The same bits as numpy's add in that order followed by a multiply by the scale rounded to the dtype
 *   (ops.scale_into): IEEE adds and multiplies, no reassociation, no contraction (-ffp-contract=off).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define RT_STREAM 1
#define RT_AVX __attribute__((target("avx")))
#endif

#ifdef RT_STREAM
/* 32-byte non-temporal stores: on the AMD EPYC (Zen 3) these were measured on, 16-byte ones (SSE2) write 64 MB
 * slower than ordinary stores (4.0 vs 3.3 ms) and 32-byte ones faster (2.6 ms). So only CPUs with AVX stream. */
static int rt_has_avx(void)
{
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx") ? 1 : 0;
    }
    return known;
}

RT_AVX static void stream_copy(char *dst, const char *src, size_t n)
{
    size_t head = (size_t)(-(uintptr_t)dst & 31);
    if (n < head + 128) {
        memcpy(dst, src, n);
        return;
    }
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t blocks = n / 128;
    for (size_t i = 0; i < blocks; i++) {
        const __m256i *s = (const __m256i *)(src + 128 * i);
        __m256i *d = (__m256i *)(dst + 128 * i);
        __m256i a = _mm256_loadu_si256(s), b = _mm256_loadu_si256(s + 1), c = _mm256_loadu_si256(s + 2),
                e = _mm256_loadu_si256(s + 3);
        _mm256_stream_si256(d, a);
        _mm256_stream_si256(d + 1, b);
        _mm256_stream_si256(d + 2, c);
        _mm256_stream_si256(d + 3, e);
    }
    memcpy(dst + 128 * blocks, src + 128 * blocks, n - 128 * blocks);
    _mm_sfence();
}

#define RT_MAX_REGIONS 256

/* one element without vectors (the head before dst's 32-byte boundary, and the tail): the same adds in the same
   order as the vector loop, so every element has the same bits whichever loop wrote it */
#define REDUCE_PUSH_ONE(T, i)                                                                                      \
    {                                                                                                              \
        T acc = o[i];                                                                                              \
        for (int k = 0; k < nreg; k++) acc = acc + ((T *)regions[k])[i];                                           \
        if (scaled) acc = acc * f;                                                                                 \
        for (int k = 0; k < nreg; k++) ((T *)regions[k])[i] = acc;                                                 \
        d[i] = acc;                                                                                                \
    }

/* dst is itemsize-aligned (checked by the caller), so the scalar head reaches its 32-byte boundary */
#define REDUCE_PUSH(T, VT, LOAD, ADD, MUL, STORE, STREAM, SET1, LANES)                                             \
    {                                                                                                              \
        T *d = (T *)dst;                                                                                           \
        const T *o = (const T *)own;                                                                               \
        T f = (T)scale;                                                                                            \
        size_t i = 0;                                                                                              \
        for (; i < n && ((uintptr_t)(d + i) & 31); i++) REDUCE_PUSH_ONE(T, i)                                      \
        VT vf = SET1(f);                                                                                           \
        for (; i + LANES <= n; i += LANES) {                                                                       \
            VT acc = LOAD(o + i);                                                                                  \
            for (int k = 0; k < nreg; k++) acc = ADD(acc, LOAD((T *)regions[k] + i));                              \
            if (scaled) acc = MUL(acc, vf);                                                                        \
            for (int k = 0; k < nreg; k++) STORE((T *)regions[k] + i, acc);                                        \
            STREAM(d + i, acc);                                                                                    \
        }                                                                                                          \
        for (; i < n; i++) REDUCE_PUSH_ONE(T, i)                                                                   \
    }

RT_AVX static void reduce_push(int kind, char *dst, const char *own, char **regions, int nreg, size_t n,
                               double scale, int scaled)
{
    if (kind == 0)
        REDUCE_PUSH(float, __m256, _mm256_loadu_ps, _mm256_add_ps, _mm256_mul_ps, _mm256_storeu_ps,
                    _mm256_stream_ps, _mm256_set1_ps, 8)
    else
        REDUCE_PUSH(double, __m256d, _mm256_loadu_pd, _mm256_add_pd, _mm256_mul_pd, _mm256_storeu_pd,
                    _mm256_stream_pd, _mm256_set1_pd, 4)
    _mm_sfence();
}
#else
static int rt_has_avx(void) { return 0; }
static void stream_copy(char *dst, const char *src, size_t n) { memcpy(dst, src, n); }
static void reduce_push(int kind, char *dst, const char *own, char **regions, int nreg, size_t n, double scale,
                        int scaled) {}
#define RT_MAX_REGIONS 256
#endif

static PyObject *py_reduce_push(PyObject *self, PyObject *args)
{
    int kind;
    double scale;
    Py_buffer dst, own, bufs[RT_MAX_REGIONS];
    PyObject *regions;
    char *pointers[RT_MAX_REGIONS];
    if (!PyArg_ParseTuple(args, "iw*y*O!d", &kind, &dst, &own, &PyTuple_Type, &regions, &scale))
        return NULL;
    Py_ssize_t nreg = PyTuple_GET_SIZE(regions), got = 0;
    Py_ssize_t itemsize = kind == 0 ? 4 : 8;
    PyObject *error = NULL;
    if ((kind != 0 && kind != 1) || nreg < 1 || nreg > RT_MAX_REGIONS || dst.len != own.len || dst.len % itemsize)
        error = PyExc_ValueError;
    for (; !error && got < nreg; got++) {
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(regions, got), &bufs[got], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            PyBuffer_Release(&dst);
            PyBuffer_Release(&own);
            for (Py_ssize_t k = 0; k < got; k++) PyBuffer_Release(&bufs[k]);
            return NULL;
        }
        pointers[got] = (char *)bufs[got].buf;
        if (bufs[got].len != dst.len) {
            error = PyExc_ValueError;
            got++;
            break;
        }
    }
    if (!rt_has_avx())
        error = PyExc_RuntimeError;
    if (!error) {
        Py_BEGIN_ALLOW_THREADS
        reduce_push(kind, (char *)dst.buf, (const char *)own.buf, pointers, (int)nreg, (size_t)(dst.len / itemsize),
                    scale, scale != 1.0);
        Py_END_ALLOW_THREADS
    }
    for (Py_ssize_t k = 0; k < got; k++) PyBuffer_Release(&bufs[k]);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&own);
    if (error) {
        PyErr_Format(error, "reduce_push: kind %d (0 float32, 1 float64), 1-%d regions, every buffer of dst's %zd "
                     "bytes, whole elements (got %zd regions, own of %zd bytes)", kind, RT_MAX_REGIONS, dst.len,
                     nreg, own.len);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *py_copy(PyObject *self, PyObject *args)
{
    Py_buffer dst, src;
    if (!PyArg_ParseTuple(args, "w*y*", &dst, &src))
        return NULL;
    if (dst.len != src.len) {
        PyErr_Format(PyExc_ValueError, "stream copy: destination of %zd bytes, source of %zd", dst.len, src.len);
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    if (rt_has_avx())
        stream_copy((char *)dst.buf, (const char *)src.buf, (size_t)dst.len);
    else
        memcpy(dst.buf, src.buf, (size_t)dst.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    Py_RETURN_NONE;
}

static PyObject *py_streams(PyObject *self, PyObject *args)
{
    if (rt_has_avx())
        Py_RETURN_TRUE;
    Py_RETURN_FALSE;
}

static PyMethodDef methods[] = {
    {"copy", py_copy, METH_VARARGS, "copy(dst, src): dst <- src with non-temporal stores where the CPU has them"},
    {"reduce_push", py_reduce_push, METH_VARARGS, "reduce_push(kind, dst, own, regions, scale): see the source"},
    {"streams", py_streams, METH_NOARGS, "True when copy() uses non-temporal stores"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_stream_copy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__stream_copy(void) { return PyModule_Create(&module); }
