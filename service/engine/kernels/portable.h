// The matvec's definition in GCC/Clang vector extensions, for any target (quantized.h uses it
// where simd.h has no kernel for the build's target, and the tests hold simd.h to its bits).
#pragma once

#include <cstdint>
#include <cstring>
#include <new>
#include <vector>

#include "mlx/types/half_types.h"

namespace lmspd {

// Float storage on cache-line boundaries. MLX's CPU buffers start 8 bytes past a 16-byte
// boundary (its allocator keeps each buffer's size in front of it), so the kernels' 32-byte loads
// of an activation straddle two cache lines every other load: a product of 8 rows took 1.45x as
// long (docs/benchmarks.md, "Fifth pass"). The matvecs read x from here (arrays.h, aligned_rows_of).
template <typename T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <typename U>
  Aligned64(const Aligned64<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const Aligned64<U>&) const {
    return true;
  }
};
using Floats = std::vector<float, Aligned64<float>>;

typedef float v8f __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));

// MLX's packing: element j of a row is bits [BITS * j, BITS * (j + 1)) of the row's words.
template <int BITS>
struct Unpack {
  v8u shift, word, mask;
  Unpack() {
    for (int l = 0; l < 8; ++l) {
      shift[l] = (l * BITS) % 32;
      word[l] = (l * BITS) / 32;
      mask[l] = (1u << BITS) - 1u;
    }
  }
  // Elements [8i, 8i + 8) of the group whose words start at wg, as floats.
  v8f operator()(const uint32_t* wg, int i) const {
    const uint32_t* wi = wg + i * 8 * BITS / 32;
    v8u words;
    for (int l = 0; l < 8; ++l) words[l] = wi[word[l]];
    const uint32_t offset = (i * 8 * BITS) % 32;  // 2-bit: odd vectors start mid-word
    return __builtin_convertvector((words >> (shift + offset)) & mask, v8f);
  }
};

// a * b + c rounded once, lane by lane (what an FMA instruction does).
inline v8f fma8(v8f a, v8f b, v8f c) {
  v8f r;
  for (int l = 0; l < 8; ++l) r[l] = __builtin_fmaf(a[l], b[l], c[l]);
  return r;
}

// Each group's sum of x, per row, laid out for the kernels as [block of 8 rows][group][row]:
// the biases' share of a product is bias * sum(x), once per group.
inline Floats group_sums(const float* x, int M, int K, int GS) {
  const int G = K / GS;
  Floats xsum(size_t((M + 7) / 8) * G * 8, 0.f);
  for (int m = 0; m < M; ++m)
    for (int g = 0; g < G; ++g) {
      float sum = 0;
      for (int j = 0; j < GS; ++j) sum += x[size_t(m) * K + g * GS + j];
      xsum[(size_t(m / 8) * G + g) * 8 + m % 8] = sum;
    }
  return xsum;
}

// The matvec in vector extensions. Its arithmetic is the definition simd.h reproduces: the
// fused multiply-adds are explicit, so no compiler contracts it another way.
template <int BITS, int GS, typename S>
void qmv_portable(const float* x, const float* xsum, const uint32_t* w, const S* scales, const S* biases,
                  float* out, int M, int N, int K, int n0, int n1) {
  constexpr int G_WORDS = GS * BITS / 32;  // packed words per group
  constexpr int VECS = GS / 8;            // float vectors per group
  const int G = K / GS;
  const int W = K * BITS / 32;
  const Unpack<BITS> unpack;
  const v8f zero = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int n = n0; n < n1; ++n) {
    const uint32_t* wn = w + (size_t)n * W;
    const S* sn = scales + (size_t)n * G;
    const S* bn = biases + (size_t)n * G;
    for (int m0 = 0; m0 < M; m0 += 8) {
      const int mc = M - m0 < 8 ? M - m0 : 8;
      v8f res[8];
      float bsum[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int mm = 0; mm < 8; ++mm) res[mm] = zero;
      for (int g = 0; g < G; ++g) {
        const uint32_t* wg = wn + g * G_WORDS;
        v8f q[VECS];  // this group's quantized values, unpacked once for all rows
        for (int i = 0; i < VECS; ++i) q[i] = unpack(wg, i);
        const float sg = static_cast<float>(sn[g]), bg = static_cast<float>(bn[g]);
        v8f sv;
        for (int l = 0; l < 8; ++l) sv[l] = sg;
        for (int mm = 0; mm < mc; ++mm) {
          const float* xg = x + (size_t)(m0 + mm) * K + g * GS;
          v8f acc = zero;
          for (int i = 0; i < VECS; ++i) {
            v8f xv;
            std::memcpy(&xv, xg + i * 8, sizeof(v8f));
            acc = fma8(xv, q[i], acc);
          }
          res[mm] = fma8(sv, acc, res[mm]);
          bsum[mm] = __builtin_fmaf(bg, xsum[((size_t)(m0 / 8) * G + g) * 8 + mm], bsum[mm]);
        }
      }
      for (int mm = 0; mm < mc; ++mm) {
        const v8f r = res[mm];
        out[(size_t)(m0 + mm) * N + n] = (((r[0] + r[4]) + (r[1] + r[5])) + ((r[2] + r[6]) + (r[3] + r[7]))) + bsum[mm];
      }
    }
  }
}

}  // namespace lmspd
