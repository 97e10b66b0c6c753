// fp32 <-> fp16/bf16 casts for gradient compression (Compression.fp16 / .bf16 in the torch binding).
//
//   cast_<from>_to_<to>(dst, src, n, scale)   dst = (to)(src * scale), round-to-nearest-even
//
// Four elements per thread per step: a 16-byte float4 on the fp32 side and an 8-byte load/store on the
// 16-bit side, so both sides stay vectorised even though the element sizes differ. The scale lets the
// caller fold a prescale (e.g. 1/N before compressing, to keep fp16 sums from overflowing) into the cast.
#include "common.cuh"

template <typename T> struct alignas(4 * sizeof(T)) Quad { T v[4]; };

template <typename S, typename D>
__device__ __forceinline__ void cast_span(D* __restrict__ dst, const S* __restrict__ src, i64 n, float scale) {
    GridStride g;
    // Start the vector body where src is 4-element aligned; use it only if dst is aligned there too.
    const u64 s = (u64)src, quad = 4 * sizeof(S);
    i64 head = (i64)(((quad - (s % quad)) % quad) / sizeof(S));
    if (head > n) head = n;
    if (((u64)(dst + head)) % (4 * sizeof(D)) != 0) head = n;
    for (i64 i = g.first; i < head; i += g.step)
        dst[i] = Math<D>::store((float)Math<S>::load(src[i]) * scale);
    const i64 nquad = (n - head) / 4;
    const Quad<S>* sq = reinterpret_cast<const Quad<S>*>(src + head);
    Quad<D>* dq = reinterpret_cast<Quad<D>*>(dst + head);
    for (i64 i = g.first; i < nquad; i += g.step) {
        Quad<S> in = sq[i];
        Quad<D> out;
#pragma unroll
        for (int k = 0; k < 4; ++k) out.v[k] = Math<D>::store((float)Math<S>::load(in.v[k]) * scale);
        dq[i] = out;
    }
    for (i64 i = head + nquad * 4 + g.first; i < n; i += g.step)
        dst[i] = Math<D>::store((float)Math<S>::load(src[i]) * scale);
}

#define RT_CAST_KERNEL(FROM, S, TO, D)                                                                     \
    extern "C" __global__ void cast_##FROM##_to_##TO(D* __restrict__ dst, const S* __restrict__ src,       \
                                                     long long n, float scale) {                           \
        cast_span<S, D>(dst, src, n, scale);                                                               \
    }

RT_CAST_KERNEL(float32, float, float16, __half)
RT_CAST_KERNEL(float32, float, bfloat16, __nv_bfloat16)
RT_CAST_KERNEL(float16, __half, float32, float)
RT_CAST_KERNEL(bfloat16, __nv_bfloat16, float32, float)
