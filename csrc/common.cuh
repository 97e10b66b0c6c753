// Shared by every ringtrain kernel: the dtype list, arithmetic in a wide-enough type, and the
// grid-stride loops that move 16 bytes per load whenever the two pointers allow it.
//
// Compiled at run time by NVRTC (ringtrain/kernels.py) and in CI by `nvcc -cubin`, so it uses no host
// headers: NVRTC has neither <cstdint> nor the C++ standard library.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

typedef long long i64;
typedef unsigned long long u64;

// Every dtype ringtrain moves on the GPU, as (name used in kernel symbols, C type).
// bool reuses uint8 (Min == logical and, Max == logical or on 0/1 bytes), so it needs no kernels of its own.
#define RT_FOR_EACH_DTYPE(X) \
    X(float16, __half) \
    X(bfloat16, __nv_bfloat16) \
    X(float32, float) \
    X(float64, double) \
    X(int8, signed char) \
    X(uint8, unsigned char) \
    X(int32, int) \
    X(int64, long long) \
    X(int16, short) \
    X(uint16, unsigned short)

// Math<T>::acc is the type arithmetic happens in. 16-bit floats widen to float, exactly as numpy and
// ml_dtypes compute float16/bfloat16 ufuncs (compute in float32, round once), so results match the reference.
template <typename T> struct Math {
    typedef T acc;
    static __device__ __forceinline__ acc load(T x) { return x; }
    static __device__ __forceinline__ T store(acc x) { return (T)x; }
};
template <> struct Math<__half> {
    typedef float acc;
    static __device__ __forceinline__ float load(__half x) { return __half2float(x); }
    static __device__ __forceinline__ __half store(float x) { return __float2half_rn(x); }
};
template <> struct Math<__nv_bfloat16> {
    typedef float acc;
    static __device__ __forceinline__ float load(__nv_bfloat16 x) { return __bfloat162float(x); }
    static __device__ __forceinline__ __nv_bfloat16 store(float x) { return __float2bfloat16_rn(x); }
};

// Scaling for Average and pre/post-scale factors. Floats multiply. Integers divide by `divisor`, rounding
// toward zero as Horovod's integer Average (ringtrain.ops.truncating_divide), when the factor is an exact 1/k,
// else they multiply in double and truncate (numpy's astype).
__device__ __forceinline__ float scale_value(float x, double s, i64) { return x * (float)s; }
__device__ __forceinline__ double scale_value(double x, double s, i64) { return x * s; }
// Division in the narrowest type that holds the value: 64-bit integer division is many times slower
// than 32-bit on the GPU, and int8/int16/int32 never need it.
template <typename I> struct Wide { typedef int type; };
template <> struct Wide<long long> { typedef long long type; };
// 8-bit values (|x| < 2**24) divide exactly in float: a correctly rounded quotient never crosses an
// integer, and float division is several times cheaper than integer division by a runtime divisor.
__device__ __forceinline__ signed char trunc_div_small(signed char x, i64 d) {
    return (signed char)truncf(__fdiv_rn((float)x, (float)d));
}
template <typename I> __device__ __forceinline__ I scale_signed(I x, double s, i64 d) {
    typedef typename Wide<I>::type W;
    if (sizeof(I) == 1 && d > 1) return (I)trunc_div_small((signed char)x, d);
    if (d > 1) return (I)((W)x / (W)d);     // C division truncates toward zero, as Horovod's Average
    return (I)((double)x * s);
}
template <typename I> __device__ __forceinline__ I scale_unsigned(I x, double s, i64 d) {
    if (d > 1) return (I)__fdiv_rz((float)x, (float)d);   // uint8/uint16 (< 2**24): exact as trunc_div_small
    return (I)((double)x * s);
}
__device__ __forceinline__ signed char scale_value(signed char x, double s, i64 d) { return scale_signed(x, s, d); }
__device__ __forceinline__ int scale_value(int x, double s, i64 d) { return scale_signed(x, s, d); }
__device__ __forceinline__ long long scale_value(long long x, double s, i64 d) { return scale_signed(x, s, d); }
__device__ __forceinline__ unsigned char scale_value(unsigned char x, double s, i64 d) { return scale_unsigned(x, s, d); }
__device__ __forceinline__ short scale_value(short x, double s, i64 d) { return scale_signed(x, s, d); }
__device__ __forceinline__ unsigned short scale_value(unsigned short x, double s, i64 d) { return scale_unsigned(x, s, d); }

// The thread's position in a 1-D grid-stride loop over the x dimension (y is left free for batching).
struct GridStride {
    i64 first, step;
    __device__ GridStride()
        : first((i64)blockIdx.x * blockDim.x + threadIdx.x), step((i64)gridDim.x * blockDim.x) {}
};

// dst[i] = f(dst[i], src[i]) (READS_DST) or dst[i] = f(src[i]) for i < n.
// When dst and src sit at the same offset modulo 16 bytes (always true for the ring: both are the same
// block of equally aligned buffers) the body moves whole 16-byte vectors: one 128-bit load per pointer
// per thread is what saturates HBM; 4-byte loads leave a quarter of the bandwidth on the table.
// The few elements before the first aligned address and after the last whole vector go one by one.
template <typename T, bool READS_DST, typename F>
__device__ __forceinline__ void elementwise_span(T* __restrict__ dst, const T* __restrict__ src, i64 n, F f) {
    const int V = 16 / sizeof(T);
    GridStride g;
    const u64 d = (u64)dst, s = (u64)src;
    i64 head = n;                                   // misaligned pair: everything goes scalar
    if (((d ^ s) & 15) == 0) {
        head = (i64)(((16 - (d & 15)) & 15) / sizeof(T));
        if (head > n) head = n;
    }
    for (i64 i = g.first; i < head; i += g.step)
        dst[i] = READS_DST ? f(dst[i], src[i]) : f(src[i], src[i]);
    const i64 nvec = (n - head) / V;
    uint4* dv = reinterpret_cast<uint4*>(dst + head);
    const uint4* sv = reinterpret_cast<const uint4*>(src + head);
    for (i64 i = g.first; i < nvec; i += g.step) {
        uint4 b = sv[i];
        uint4 a = READS_DST ? dv[i] : b;
        T* ta = reinterpret_cast<T*>(&a);
        const T* tb = reinterpret_cast<const T*>(&b);
#pragma unroll
        for (int k = 0; k < V; ++k) ta[k] = READS_DST ? f(ta[k], tb[k]) : f(tb[k], tb[k]);
        dv[i] = a;
    }
    for (i64 i = head + nvec * V + g.first; i < n; i += g.step)
        dst[i] = READS_DST ? f(dst[i], src[i]) : f(src[i], src[i]);
}
