// Fusion-buffer pack and unpack: many tensors in ONE launch.
//
// A launch gets a device table of rows {dst address, src address, count} (int64 each). blockIdx.y picks
// the row (striding when there are more rows than gridDim.y), blockIdx.x/threadIdx.x grid-stride inside
// it. One launch instead of one per tensor matters because a model has hundreds of small gradients and
// each launch costs ~3-5 us of CPU time on the engine thread.
//
//   batched_copy(table, rows)                  count = bytes; pack (tensors -> buffer) and unpack alike
//   batched_scale_<dtype>(table, rows, s, d)   count = elements; dst = src * s (Average's 1/N, prescale)
#include "common.cuh"

// Copy nbytes with the widest unit U for which dst and src are equally misaligned: bytes until dst is
// U-aligned, then whole U's, then the tail bytes. Tensors packed back to back keep only their element
// alignment relative to the buffer, so a 16-byte-only fast path would miss most of them.
template <typename U>
__device__ __forceinline__ void copy_span(char* __restrict__ dst, const char* __restrict__ src, i64 nbytes) {
    GridStride g;
    i64 head = (i64)((sizeof(U) - ((u64)dst % sizeof(U))) % sizeof(U));
    if (head > nbytes) head = nbytes;
    for (i64 i = g.first; i < head; i += g.step) dst[i] = src[i];
    const i64 nunits = (nbytes - head) / (i64)sizeof(U);
    U* du = reinterpret_cast<U*>(dst + head);
    const U* su = reinterpret_cast<const U*>(src + head);
    for (i64 i = g.first; i < nunits; i += g.step) du[i] = su[i];
    for (i64 i = head + nunits * (i64)sizeof(U) + g.first; i < nbytes; i += g.step) dst[i] = src[i];
}

__device__ __forceinline__ void copy_bytes(char* dst, const char* src, i64 nbytes) {
    const u64 skew = (u64)dst ^ (u64)src;
    if ((skew & 15) == 0) copy_span<uint4>(dst, src, nbytes);
    else if ((skew & 7) == 0) copy_span<u64>(dst, src, nbytes);
    else if ((skew & 3) == 0) copy_span<unsigned int>(dst, src, nbytes);
    else if ((skew & 1) == 0) copy_span<unsigned short>(dst, src, nbytes);
    else copy_span<unsigned char>(dst, src, nbytes);
}

extern "C" __global__ void batched_copy(const long long* __restrict__ table, int rows) {
    for (int r = blockIdx.y; r < rows; r += gridDim.y)
        copy_bytes(reinterpret_cast<char*>(table[3 * r]), reinterpret_cast<const char*>(table[3 * r + 1]),
                   table[3 * r + 2]);
}

template <typename T> struct ScaleBy {
    double scale;
    i64 divisor;
    __device__ __forceinline__ T operator()(T, T x) const {
        return Math<T>::store(scale_value(Math<T>::load(x), scale, divisor));
    }
};

#define RT_BATCHED_SCALE_KERNEL(NAME, T)                                                                   \
    extern "C" __global__ void batched_scale_##NAME(const long long* __restrict__ table, int rows,          \
                                                    double scale, long long divisor) {                     \
        ScaleBy<T> f{scale, divisor};                                                                      \
        for (int r = blockIdx.y; r < rows; r += gridDim.y)                                                 \
            elementwise_span<T, false>(reinterpret_cast<T*>(table[3 * r]),                                 \
                                       reinterpret_cast<const T*>(table[3 * r + 1]), table[3 * r + 2], f); \
    }

RT_FOR_EACH_DTYPE(RT_BATCHED_SCALE_KERNEL)
