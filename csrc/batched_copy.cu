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

// Copy nbytes. dst is first brought to 16-byte alignment with single bytes; then every thread writes one
// whole 16-byte vector per step, gathering it from src in units U, the widest for which src is aligned
// there (dst and src are equally misaligned modulo sizeof(U)). Tensors packed back to back keep only their
// element alignment relative to the buffer, so a 16-byte-only fast path would miss most of them, and
// 4-byte stores alone leave too few bytes in flight to fill HBM.
template <typename U>
__device__ __forceinline__ void copy_span(char* __restrict__ dst, const char* __restrict__ src, i64 nbytes) {
    const int K = 16 / sizeof(U);
    GridStride g;
    i64 head = (i64)((16 - ((u64)dst & 15)) & 15);
    if (head > nbytes) head = nbytes;
    for (i64 i = g.first; i < head; i += g.step) dst[i] = src[i];
    const i64 nvec = (nbytes - head) / 16;
    uint4* dv = reinterpret_cast<uint4*>(dst + head);
    const U* su = reinterpret_cast<const U*>(src + head);
    for (i64 i = g.first; i < nvec; i += g.step) {
        union { uint4 v; U u[K]; } chunk;
#pragma unroll
        for (int k = 0; k < K; ++k) chunk.u[k] = su[i * K + k];
        dv[i] = chunk.v;
    }
    for (i64 i = head + nvec * 16 + g.first; i < nbytes; i += g.step) dst[i] = src[i];
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
