// The ring's reduce step: dst = (dst op src) * scale, elementwise, in place.
//
// One kernel per (op, dtype): reduce_<op>_<dtype>(dst, src, n, scale, divisor), e.g. reduce_sum_float32.
// Average is launched as sum with scale = 1/N, so the division costs no extra pass over memory.
// `divisor` is round(1/scale) when that is exact, for integer division rounding toward zero (see scale_value).
// The kernel is memory bound (2 loads + 1 store per element); its speed is measured against a
// device-to-device copy in benchmarks/gpu_kernels.py.
#include "common.cuh"

struct OpSum {
    template <typename A> static __device__ __forceinline__ A apply(A a, A b) { return (A)(a + b); }
};
struct OpProduct {
    template <typename A> static __device__ __forceinline__ A apply(A a, A b) { return (A)(a * b); }
};
// `b != b` is true only for NaN: like numpy.minimum/maximum, a NaN on either side wins.
struct OpMin {
    template <typename A> static __device__ __forceinline__ A apply(A a, A b) { return (b < a || b != b) ? b : a; }
};
struct OpMax {
    template <typename A> static __device__ __forceinline__ A apply(A a, A b) { return (b > a || b != b) ? b : a; }
};

template <typename T, typename Op> struct Combine {
    double scale;
    i64 divisor;
    bool scaled;     // uniform across the grid, so this branch never diverges
    __device__ __forceinline__ T operator()(T a, T b) const {
        typename Math<T>::acc r = Op::apply(Math<T>::load(a), Math<T>::load(b));
        if (scaled) r = scale_value(r, scale, divisor);
        return Math<T>::store(r);
    }
};

template <typename T, typename Op>
__device__ __forceinline__ void reduce_span(T* dst, const T* src, i64 n, double scale, i64 divisor) {
    Combine<T, Op> f{scale, divisor, scale != 1.0 || divisor > 1};
    elementwise_span<T, true>(dst, src, n, f);
}

#define RT_REDUCE_KERNEL(OPNAME, OP, NAME, T)                                                           \
    extern "C" __global__ void reduce_##OPNAME##_##NAME(T* __restrict__ dst, const T* __restrict__ src, \
                                                       long long n, double scale, long long divisor) {  \
        reduce_span<T, OP>(dst, src, n, scale, divisor);                                                \
    }

#define RT_REDUCE_ALL_OPS(NAME, T)                \
    RT_REDUCE_KERNEL(sum, OpSum, NAME, T)         \
    RT_REDUCE_KERNEL(min, OpMin, NAME, T)         \
    RT_REDUCE_KERNEL(max, OpMax, NAME, T)         \
    RT_REDUCE_KERNEL(product, OpProduct, NAME, T)

RT_FOR_EACH_DTYPE(RT_REDUCE_ALL_OPS)
