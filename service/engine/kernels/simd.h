// The matvec kernel in explicit SIMD: AVX2 + FMA + F16C on x86-64, NEON on arm64, chosen at
// build time by the compiler's target (-march=native, so the build key's CPU decides).
// Where the target also has AVX-512VL, a 4-bit weight's float comes from a table in one
// instruction instead of a mask and a conversion (the same values).
//
// Bit for bit the portable kernel's arithmetic (portable.h, qmv_portable), which is the one
// lmspd has always computed: per output, 8 float32 lanes; per group, lane l sums x * q over the
// group's elements 8i + l with fused multiply-adds in order of i, the group's sum is added in as
// fma(scale, sum, total), the biases' share as a scalar fma(bias, sum(x of the group), b); at
// the end ((r0 + r4) + (r1 + r5)) + ((r2 + r6) + (r3 + r7)) + b. The speed comes from how the
// work is laid out, never from another order: each group's nibbles are unpacked in registers
// once for all rows of x (and, at one row, x is loaded once for four output rows), the scales
// are widened to float32 a row at a time with vector conversions, and the next group is
// prefetched.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "mlx/types/half_types.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LMSPD_SIMD_AVX2 1
#include <immintrin.h>
#elif defined(__aarch64__)
#define LMSPD_SIMD_NEON 1
#include <arm_neon.h>
#endif

#if defined(LMSPD_SIMD_AVX2) || defined(LMSPD_SIMD_NEON)
#define LMSPD_SIMD 1

namespace lmspd {

#if defined(LMSPD_SIMD_AVX2)
inline constexpr const char* kSimd = "avx2";
using V = __m256;  // the 8 lanes
inline V vzero() { return _mm256_setzero_ps(); }
inline V vset1(float f) { return _mm256_set1_ps(f); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm256_storeu_ps(p, v); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }  // a * b + c, rounded once
inline float hsum(V r) {
  const __m128 a = _mm_add_ps(_mm256_castps256_ps128(r), _mm256_extractf128_ps(r, 1));  // r_l + r_{l+4}
  const __m128 h = _mm_hadd_ps(a, a);                                                    // a0 + a1, a2 + a3
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
inline V from_u32(__m256i q) { return _mm256_cvtepi32_ps(q); }  // q < 2^8: exact

template <int BITS>
struct Unpacker;
template <>
struct Unpacker<4> {
  const __m256i shift = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28), mask = _mm256_set1_epi32(15);
#if defined(__AVX512VL__)
  // The nibble's float from a table of 0..15: vpermt2ps reads only an index's low four bits,
  // so one instruction does the mask's and the conversion's work, with the same values.
  const V low = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), high = _mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15);
  V operator()(const uint32_t* wg, int i) const {
    return _mm256_permutex2var_ps(low, _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(wg[i])), shift), high);
  }
#else
  V operator()(const uint32_t* wg, int i) const {
    return from_u32(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(wg[i])), shift), mask));
  }
#endif
};
template <>
struct Unpacker<8> {
  V operator()(const uint32_t* wg, int i) const {
    return from_u32(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wg + 2 * i))));
  }
};
template <>
struct Unpacker<2> {
  const __m256i even = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14), odd = _mm256_setr_epi32(16, 18, 20, 22, 24, 26, 28, 30);
  const __m256i mask = _mm256_set1_epi32(3);
  V operator()(const uint32_t* wg, int i) const {
    const __m256i w = _mm256_set1_epi32(static_cast<int>(wg[i / 2]));
    return from_u32(_mm256_and_si256(_mm256_srlv_epi32(w, (i & 1) ? odd : even), mask));
  }
};

inline void widen(const mlx::core::float16_t* s, float* out, int n) {
  int i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
  for (; i < n; ++i) out[i] = static_cast<float>(s[i]);
}
inline void widen(const mlx::core::bfloat16_t* s, float* out, int n) {
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
    _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(h, 16)));
  }
  for (; i < n; ++i) out[i] = static_cast<float>(s[i]);
}

#else  // NEON: the 8 lanes as two quads
inline constexpr const char* kSimd = "neon";
struct V {
  float32x4_t lo, hi;
};
inline V vzero() { return {vdupq_n_f32(0.f), vdupq_n_f32(0.f)}; }
inline V vset1(float f) { return {vdupq_n_f32(f), vdupq_n_f32(f)}; }
inline V vload(const float* p) { return {vld1q_f32(p), vld1q_f32(p + 4)}; }
inline void vstore(float* p, V v) {
  vst1q_f32(p, v.lo);
  vst1q_f32(p + 4, v.hi);
}
inline V vfma(V a, V b, V c) { return {vfmaq_f32(c.lo, a.lo, b.lo), vfmaq_f32(c.hi, a.hi, b.hi)}; }
inline float hsum(V r) {
  const float32x4_t a = vaddq_f32(r.lo, r.hi);  // r_l + r_{l+4}
  const float32x4_t h = vpaddq_f32(a, a);       // a0 + a1, a2 + a3
  return vgetq_lane_f32(h, 0) + vgetq_lane_f32(h, 1);
}

template <int BITS>
struct Unpacker {  // 2 and 4 bits: lane l is bits [BITS * l, BITS * (l + 1)) past the vector's offset
  const uint32x4_t mask = vdupq_n_u32((1u << BITS) - 1u);
  int32x4_t lo, hi, lo2, hi2;  // negated shifts (NEON shifts right by a negative left shift)
  Unpacker() {
    for (int l = 0; l < 4; ++l) {
      lo[l] = -(l * BITS);
      hi[l] = -((l + 4) * BITS);
      lo2[l] = lo[l] - 16;
      hi2[l] = hi[l] - 16;
    }
  }
  V operator()(const uint32_t* wg, int i) const {
    const bool second = BITS == 2 && (i & 1);
    const uint32x4_t w = vdupq_n_u32(wg[i * BITS / 4]);
    return {vcvtq_f32_u32(vandq_u32(vshlq_u32(w, second ? lo2 : lo), mask)),
            vcvtq_f32_u32(vandq_u32(vshlq_u32(w, second ? hi2 : hi), mask))};
  }
};
template <>
struct Unpacker<8> {
  V operator()(const uint32_t* wg, int i) const {
    const uint16x8_t h = vmovl_u8(vld1_u8(reinterpret_cast<const uint8_t*>(wg + 2 * i)));
    return {vcvtq_f32_u32(vmovl_u16(vget_low_u16(h))), vcvtq_f32_u32(vmovl_high_u16(h))};
  }
};

inline void widen(const mlx::core::float16_t* s, float* out, int n) {
  int i = 0;
  for (; i + 4 <= n; i += 4) vst1q_f32(out + i, vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t*>(s + i)))));
  for (; i < n; ++i) out[i] = static_cast<float>(s[i]);
}
inline void widen(const mlx::core::bfloat16_t* s, float* out, int n) {
  int i = 0;
  for (; i + 4 <= n; i += 4)
    vst1q_f32(out + i, vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(reinterpret_cast<const uint16_t*>(s + i)), 16)));
  for (; i < n; ++i) out[i] = static_cast<float>(s[i]);
}
#endif

inline void widen(const float* s, float* out, int n) { std::memcpy(out, s, sizeof(float) * n); }

// One group's share for one row of x: lane l sums x * q over elements 8i + l, in order of i.
template <int VECS, typename Q>
inline V group_dot(const float* xg, const Q& q) {
  V acc = vzero();
#pragma GCC unroll 16
  for (int i = 0; i < VECS; ++i) acc = vfma(vload(xg + 8 * i), q(i), acc);
  return acc;
}

// Output columns [n, n + T) at one row, T known at compile time so that the tile's
// accumulators stay in registers (a run-time tile width spilled them and branched per column):
// x's group is loaded once for all T columns. sf and bf: the T columns' scales and biases,
// widened, [column][group].
template <int T, int BITS, int GS>
inline void qmv_row_tile(const float* x, const float* xsum, const uint32_t* wn, const float* sf, const float* bf,
                         float* out, int G, int W, const Unpacker<BITS>& unpack) {
  constexpr int G_WORDS = GS * BITS / 32;
  constexpr int VECS = GS / 8;
  V res[T];
  float bsum[T];
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t) {
    res[t] = vzero();
    bsum[t] = 0;
  }
  for (int g = 0; g < G; ++g) {
    const float* xg = x + g * GS;
    V xv[VECS];
#pragma GCC unroll 16
    for (int i = 0; i < VECS; ++i) xv[i] = vload(xg + 8 * i);
    const float xs = xsum[size_t(g) * 8];
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) {
      const uint32_t* wg = wn + size_t(t) * W + g * G_WORDS;
      __builtin_prefetch(wg + T * W);  // the next tile's group: it streams in meanwhile
      V acc = vzero();
#pragma GCC unroll 16
      for (int i = 0; i < VECS; ++i) acc = vfma(xv[i], unpack(wg, i), acc);
      res[t] = vfma(vset1(sf[t * G + g]), acc, res[t]);
      bsum[t] = __builtin_fmaf(bf[t * G + g], xs, bsum[t]);
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t) out[t] = hsum(res[t]) + bsum[t];
}

// MC rows of x (at most 8) by TC output columns: each group's nibbles unpacked once for the MC
// rows, each row's sums in qmv_portable's order. xs: the rows' group sums, [group][8 rows].
// Not inlined: one copy per (rows, columns, bits, group) serves every scales' dtype, which keeps
// the engine's first build and the cross-compiled test's in seconds rather than minutes.
template <int MC, int TC, int BITS, int GS>
__attribute__((noinline)) void qmv_block(const float* x, const float* xs, const uint32_t* wn, const float* sf, const float* bf,
                      float* out, int N, int K, int G, int W, const Unpacker<BITS>& unpack) {
  constexpr int G_WORDS = GS * BITS / 32;
  constexpr int VECS = GS / 8;
  V res[TC][MC];
  V bsum[TC];  // lane mm: row mm's scalar bias sum, lane by lane the same fma
#pragma GCC unroll 8
  for (int t = 0; t < TC; ++t) {
    bsum[t] = vzero();
#pragma GCC unroll 8
    for (int mm = 0; mm < MC; ++mm) res[t][mm] = vzero();
  }
  for (int g = 0; g < G; ++g) {
    const float* xg = x + g * GS;
#pragma GCC unroll 4
    for (int t = 0; t < TC; ++t) {
      const uint32_t* wg = wn + size_t(t) * W + g * G_WORDS;
      __builtin_prefetch(wg + TC * W);
      V q[VECS];  // this group's quantized values, unpacked once for all rows
#pragma GCC unroll 16
      for (int i = 0; i < VECS; ++i) q[i] = unpack(wg, i);
      const V sg = vset1(sf[t * G + g]);
#pragma GCC unroll 8
      for (int mm = 0; mm < MC; ++mm)
        res[t][mm] = vfma(sg, group_dot<VECS>(xg + size_t(mm) * K, [&](int i) { return q[i]; }), res[t][mm]);
      bsum[t] = vfma(vset1(bf[t * G + g]), vload(xs + size_t(g) * 8), bsum[t]);
    }
  }
#pragma GCC unroll 4
  for (int t = 0; t < TC; ++t) {
    float b[8];
    vstore(b, bsum[t]);
#pragma GCC unroll 8
    for (int mm = 0; mm < MC; ++mm) out[size_t(mm) * N + t] = hsum(res[t][mm]) + b[mm];
  }
}

// Output columns [n0, n1) of MC rows, TC columns a block and what is left one at a time.
// sf and bf: room for TC columns' widened scales and biases.
template <int MC, int TC, int BITS, int GS, typename S>
void qmv_rows(const float* x, const float* xs, const uint32_t* w, const S* scales, const S* biases, float* sf,
              float* bf, float* out, int N, int K, int n0, int n1, const Unpacker<BITS>& unpack) {
  const int G = K / GS;
  const int W = K * BITS / 32;
  int n = n0;
  for (; n + TC <= n1; n += TC) {
    widen(scales + size_t(n) * G, sf, TC * G);
    widen(biases + size_t(n) * G, bf, TC * G);
    qmv_block<MC, TC, BITS, GS>(x, xs, w + size_t(n) * W, sf, bf, out + n, N, K, G, W, unpack);
  }
  for (; n < n1; ++n) {
    widen(scales + size_t(n) * G, sf, G);
    widen(biases + size_t(n) * G, bf, G);
    qmv_block<MC, 1, BITS, GS>(x, xs, w + size_t(n) * W, sf, bf, out + n, N, K, G, W, unpack);
  }
}

// x @ dequantize(w).T for output columns [n0, n1). xsum: each group's sum of x, laid out by
// blocks of 8 rows as [block][group][8 rows] (zero past the last row).
template <int BITS, int GS, typename S>
void qmv_simd(const float* x, const float* xsum, const uint32_t* w, const S* scales, const S* biases, float* out,
              int M, int N, int K, int n0, int n1) {
  const int G = K / GS;
  const int W = K * BITS / 32;
  const Unpacker<BITS> unpack;
  thread_local std::vector<float> buffer;
  float* sf;
  float* bf;
  if (M == 1) {
    // Four columns a tile, eight for 8-bit weights (fewer unpack instructions a weight leave
    // room for more columns in flight); what is left over, one at a time.
    constexpr int T = BITS == 8 ? 8 : 4;
    buffer.resize(size_t(2) * T * G);
    sf = buffer.data();
    bf = sf + size_t(T) * G;
    int n = n0;
    for (; n + T <= n1; n += T) {
      widen(scales + size_t(n) * G, sf, T * G);
      widen(biases + size_t(n) * G, bf, T * G);
      qmv_row_tile<T, BITS, GS>(x, xsum, w + size_t(n) * W, sf, bf, out + n, G, W, unpack);
    }
    for (; n < n1; ++n) {
      widen(scales + size_t(n) * G, sf, G);
      widen(biases + size_t(n) * G, bf, G);
      qmv_row_tile<1, BITS, GS>(x, xsum, w + size_t(n) * W, sf, bf, out + n, G, W, unpack);
    }
    return;
  }
  // Several rows: TC columns at a time (two where there are five rows or more, so that each
  // x vector loaded serves twice as many fused multiply-adds), the rows' count a template
  // argument so that their accumulators stay in registers (a run-time count kept them on the
  // stack: 1.5x slower at 8 rows).
  buffer.resize(size_t(2) * 2 * G);
  sf = buffer.data();
  bf = sf + size_t(2) * G;
  for (int m0 = 0; m0 < M; m0 += 8) {
    const int mc = M - m0 < 8 ? M - m0 : 8;
    const float* xm = x + size_t(m0) * K;
    const float* xs = xsum + size_t(m0 / 8) * G * 8;
    float* om = out + size_t(m0) * N;
    switch (mc) {
#define LMSPD_ROWS(MC)                                                                          \
  case MC:                                                                                      \
    qmv_rows<MC, (MC >= 5 ? 2 : 1), BITS, GS>(xm, xs, w, scales, biases, sf, bf, om, N, K, n0, n1, unpack); \
    break;
      LMSPD_ROWS(1) LMSPD_ROWS(2) LMSPD_ROWS(3) LMSPD_ROWS(4) LMSPD_ROWS(5) LMSPD_ROWS(6) LMSPD_ROWS(7) LMSPD_ROWS(8)
#undef LMSPD_ROWS
    }
  }
}

}  // namespace lmspd

#endif
