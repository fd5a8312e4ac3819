// The products with 8-bit activations: numerics = "fast" (docs/numerics.md).
//
// The exact path (simd.h, portable.h) computes MLX's own bits: per weight, a float32 unpack and
// a fused multiply-add, four vector instructions per eight weights and row. Here each row of x
// is quantized once per product to 8-bit integers, per block of 32 elements (d = max|x| / 127,
// q = round(x / d)), and a 4-bit group's products are integer dot products: 32 weights times 32
// activations in four instructions (vpmaddubsw, vpmaddwd, a conversion and a fused multiply-add
// by scale * d), which is how llama.cpp's CPU products run. The biases' share is bias * the
// group's sum of the quantized x (q8_group_sums: why not x's own).
//
// The arithmetic, which portable and AVX2 compute bit for bit alike (the tests hold them to it):
// x's block j of a row is stored with its even elements first, then its odd ones, the order in
// which a 4-bit row's bytes hold them as low and high nibbles. Lane k (0..7) of a block's dot is
// the integer sum of its stored elements 4k..4k+3 times their weights, exact; per output and
// row, lane k accumulates fma(float(lane), scale_g * d_j, acc_k) over the blocks in order, the
// bias share is fma(bias_g, xsum_g, b) over the groups, and the end is
// ((r0 + r4) + (r1 + r5)) + ((r2 + r6) + (r3 + r7)) + b. Every step is per row, so a row's
// result never depends on the batch it rides in: a greedy resume still equals the
// uninterrupted run on this path.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "mlx/types/half_types.h"
#include "no_contract.h"
#include "portable.h"  // Floats
#include "simd.h"      // widen, hsum (AVX2)

namespace lmspd {

constexpr int Q8_BLOCK = 32;

// x's rows as 8-bit integers: q, M rows of K (each block's even elements, then its odd ones),
// and d, M rows of K / 32 block scales.
struct Q8Rows {
  std::vector<int8_t, Aligned64<int8_t>> q;
  std::vector<float> d;
};

inline Q8Rows quantize_rows(const float* x, int M, int K) {
  const int B = K / Q8_BLOCK;
  Q8Rows r{std::vector<int8_t, Aligned64<int8_t>>(size_t(M) * K), std::vector<float>(size_t(M) * B)};
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < B; ++b) {
      const float* xb = x + size_t(m) * K + b * Q8_BLOCK;
      int8_t* qb = r.q.data() + size_t(m) * K + b * Q8_BLOCK;
      float amax = 0.f;
      bool finite = true;  // fmax passes over a NaN: each element is looked at
      for (int i = 0; i < Q8_BLOCK; ++i) {
        amax = std::fmax(amax, std::fabs(xb[i]));
        finite = finite && std::isfinite(xb[i]);
      }
      if (!finite) {  // a NaN or an infinity in x: the products say NaN, never a number
        std::memset(qb, 0, Q8_BLOCK);
        r.d[size_t(m) * B + b] = NAN;
        continue;
      }
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      for (int j = 0; j < Q8_BLOCK / 2; ++j) {
        qb[j] = static_cast<int8_t>(std::nearbyint(xb[2 * j] * inv));
        qb[Q8_BLOCK / 2 + j] = static_cast<int8_t>(std::nearbyint(xb[2 * j + 1] * inv));
      }
      r.d[size_t(m) * B + b] = amax / 127.f;
    }
  return r;
}

// Each group's sum of the quantized x, per row (the sum over its blocks j of d_j times the
// integer sum of q), laid out as group_sums lays x's own ([block of 8 rows][group][row]). The
// biases' share of a product multiplies this sum, so both shares see the same x, x_q, and the
// product is W x_q: the rounding of x moves it as much as W moves that rounding. With x's own
// float32 sums (this path's first form) the biases' share, large against the result (an affine
// group's bias is its minimum), kept x's exact sum while the scales' share carried x's rounding
// uncancelled: the products moved 2.6% where W x_q moves 0.7%, and the model's next-token
// distributions 0.023 nats (docs/benchmarks.md, "Accuracy"). llama.cpp's q8_1 keeps this sum too.
LMSPD_NO_CONTRACT_ATTR inline Floats q8_group_sums(const Q8Rows& r, int M, int K, int GS) {
  LMSPD_NO_CONTRACT
  const int G = K / GS, B = K / Q8_BLOCK, BPG = GS / Q8_BLOCK;
  Floats xsum(size_t((M + 7) / 8) * G * 8, 0.f);
  for (int m = 0; m < M; ++m)
    for (int g = 0; g < G; ++g) {
      float sum = 0.f;
      for (int jb = 0; jb < BPG; ++jb) {
        const int j = g * BPG + jb;
        const int8_t* qb = r.q.data() + size_t(m) * K + j * Q8_BLOCK;
        int32_t isum = 0;
        for (int i = 0; i < Q8_BLOCK; ++i) isum += qb[i];
        sum = __builtin_fmaf(static_cast<float>(isum), r.d[size_t(m) * B + j], sum);
      }
      xsum[(size_t(m / 8) * G + g) * 8 + m % 8] = sum;
    }
  return xsum;
}

// xs: the rows' group sums as q8_group_sums lays them out ([block of 8 rows][group][row]).
inline float q8_xsum(const float* xsum, int G, int m, int g) { return xsum[(size_t(m / 8) * G + g) * 8 + m % 8]; }

// The definition, one output at a time: what the AVX2 kernel computes.
template <int GS, typename S>
LMSPD_NO_CONTRACT_ATTR void q8_portable(const int8_t* xq, const float* xd, const float* xsum, const uint32_t* w,
                                        const S* scales, const S* biases, float* out, int M, int N, int K, int n0,
                                        int n1) {
  LMSPD_NO_CONTRACT
  constexpr int BPG = GS / Q8_BLOCK;
  const int G = K / GS, B = K / Q8_BLOCK, W = K / 8;
  for (int n = n0; n < n1; ++n) {
    const uint8_t* wn = reinterpret_cast<const uint8_t*>(w + size_t(n) * W);
    for (int m = 0; m < M; ++m) {
      float r[8] = {0, 0, 0, 0, 0, 0, 0, 0}, bsum = 0.f;
      for (int g = 0; g < G; ++g) {
        const float s = static_cast<float>(scales[size_t(n) * G + g]);
        for (int jb = 0; jb < BPG; ++jb) {
          const int j = g * BPG + jb;
          const uint8_t* wb = wn + j * (Q8_BLOCK / 2);
          const int8_t* qb = xq + size_t(m) * K + j * Q8_BLOCK;
          const float sd = s * xd[size_t(m) * B + j];
          for (int k = 0; k < 8; ++k) {
            int32_t lane = 0;
            for (int e = 4 * k; e < 4 * k + 4; ++e) {
              const int wq = e < 16 ? (wb[e] & 15) : (wb[e - 16] >> 4);
              lane += wq * qb[e];
            }
            r[k] = __builtin_fmaf(static_cast<float>(lane), sd, r[k]);
          }
        }
        bsum = __builtin_fmaf(static_cast<float>(biases[size_t(n) * G + g]), q8_xsum(xsum, G, m, g), bsum);
      }
      out[size_t(m) * N + n] = (((r[0] + r[4]) + (r[1] + r[5])) + ((r[2] + r[6]) + (r[3] + r[7]))) + bsum;
    }
  }
}

#if defined(LMSPD_SIMD_AVX2)
#define LMSPD_Q8_SIMD 1

// A block's eight lanes: lane k the integer sum of its stored elements 4k..4k+3 times their
// weights. VNNI's vpdpbusd (AVX512-VNNI with VL, or AVX-VNNI) sums the four products in one
// instruction; vpmaddubsw + vpmaddwd sum them in two (the pairs cannot saturate: 15 * 127 * 2 is
// under 2^15). The same integers either way, so the same bits (tests/engine/test_kernels_fast.py).
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
inline constexpr const char* kQ8Simd = "avx512-vnni";
inline __m256i q8_lanes(__m256i wq, __m256i xv, __m256i) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), wq, xv); }
#elif defined(__AVXVNNI__)
inline constexpr const char* kQ8Simd = "avx-vnni";
inline __m256i q8_lanes(__m256i wq, __m256i xv, __m256i) {
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), wq, xv);
}
#else
inline constexpr const char* kQ8Simd = "avx2";
inline __m256i q8_lanes(__m256i wq, __m256i xv, __m256i ones) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(wq, xv), ones);
}
#endif

// MC rows (at most 4) by TC output columns: each block's nibbles unpacked once for the MC rows.
// xq, xd: the first row's; xs: the first row's group sums (row mm of group g at g * 8 + mm).
template <int MC, int TC, int GS>
__attribute__((noinline)) void q8_block(const int8_t* xq, const float* xd, const float* xs, const uint8_t* wn,
                                        const float* sf, const float* bf, float* out, int N, int K, int G, int W) {
  constexpr int BPG = GS / Q8_BLOCK;
  const int B = K / Q8_BLOCK;
  const __m128i low = _mm_set1_epi8(15);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 res[TC][MC];
  float bsum[TC][MC];
#pragma GCC unroll 4
  for (int t = 0; t < TC; ++t)
#pragma GCC unroll 4
    for (int mm = 0; mm < MC; ++mm) {
      res[t][mm] = _mm256_setzero_ps();
      bsum[t][mm] = 0.f;
    }
  for (int g = 0; g < G; ++g) {
#pragma GCC unroll 4
    for (int t = 0; t < TC; ++t) {
      const uint8_t* wg = wn + size_t(t) * W * 4 + g * (GS / 2);
      __builtin_prefetch(wg + size_t(TC) * W * 4);  // the next tile's group: it streams in meanwhile
      const float s = sf[t * G + g];
#pragma GCC unroll 4
      for (int jb = 0; jb < BPG; ++jb) {
        const int j = g * BPG + jb;
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wg + jb * (Q8_BLOCK / 2)));
        const __m256i wq = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low), _mm_and_si128(raw, low));
#pragma GCC unroll 4
        for (int mm = 0; mm < MC; ++mm) {
          const __m256i xv = _mm256_load_si256(reinterpret_cast<const __m256i*>(xq + size_t(mm) * K + j * Q8_BLOCK));
          const __m256i lanes = q8_lanes(wq, xv, ones);
          res[t][mm] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), _mm256_set1_ps(s * xd[size_t(mm) * B + j]),
                                       res[t][mm]);
        }
      }
#pragma GCC unroll 4
      for (int mm = 0; mm < MC; ++mm) bsum[t][mm] = __builtin_fmaf(bf[t * G + g], xs[g * 8 + mm], bsum[t][mm]);
    }
  }
#pragma GCC unroll 4
  for (int t = 0; t < TC; ++t)
#pragma GCC unroll 4
    for (int mm = 0; mm < MC; ++mm) out[size_t(mm) * N + t] = hsum(res[t][mm]) + bsum[t][mm];
}

template <int MC, int TC, int GS, typename S>
void q8_rows(const int8_t* xq, const float* xd, const float* xs, const uint32_t* w, const S* scales, const S* biases,
             float* sf, float* bf, float* out, int N, int K, int n0, int n1) {
  const int G = K / GS, W = K / 8;
  const uint8_t* wb = reinterpret_cast<const uint8_t*>(w);
  int n = n0;
  for (; n + TC <= n1; n += TC) {
    widen(scales + size_t(n) * G, sf, TC * G);
    widen(biases + size_t(n) * G, bf, TC * G);
    q8_block<MC, TC, GS>(xq, xd, xs, wb + size_t(n) * W * 4, sf, bf, out + n, N, K, G, W);
  }
  for (; n < n1; ++n) {
    widen(scales + size_t(n) * G, sf, G);
    widen(biases + size_t(n) * G, bf, G);
    q8_block<MC, 1, GS>(xq, xd, xs, wb + size_t(n) * W * 4, sf, bf, out + n, N, K, G, W);
  }
}

template <int GS, typename S>
void q8_simd(const int8_t* xq, const float* xd, const float* xsum, const uint32_t* w, const S* scales,
             const S* biases, float* out, int M, int N, int K, int n0, int n1) {
  const int G = K / GS, B = K / Q8_BLOCK;
  thread_local std::vector<float> buffer;
  buffer.resize(size_t(2) * 4 * G);
  float* sf = buffer.data();
  float* bf = sf + size_t(4) * G;
  // Rows four at a time (a block of 8 rows' group sums holds two of them), the count a template
  // argument so that the accumulators stay in registers.
  for (int m0 = 0; m0 < M; m0 += 4) {
    const int mc = M - m0 < 4 ? M - m0 : 4;
    const int8_t* xm = xq + size_t(m0) * K;
    const float* dm = xd + size_t(m0) * B;
    const float* xs = xsum + size_t(m0 / 8) * G * 8 + m0 % 8;
    float* om = out + size_t(m0) * N;
    switch (mc) {
      case 1:
        q8_rows<1, 4, GS>(xm, dm, xs, w, scales, biases, sf, bf, om, N, K, n0, n1);
        break;
      case 2:
        q8_rows<2, 4, GS>(xm, dm, xs, w, scales, biases, sf, bf, om, N, K, n0, n1);
        break;
      case 3:
        q8_rows<3, 2, GS>(xm, dm, xs, w, scales, biases, sf, bf, om, N, K, n0, n1);
        break;
      default:
        q8_rows<4, 2, GS>(xm, dm, xs, w, scales, biases, sf, bf, om, N, K, n0, n1);
    }
  }
}
#endif

}  // namespace lmspd
