// The SIMD matvec (simd.h) against the portable one (portable.h), bit for bit, as a program
// with no MLX library: test_kernels_cross.py builds it for another target (arm64's NEON) and
// runs it under an emulator. It prints "<target simd> <cases> <mismatches>".
#include <cstdio>
#include <random>

#include "portable.h"
#include "simd.h"

namespace mx = mlx::core;

template <int BITS, int GS, typename S>
int check(std::mt19937& rng, int& cases) {
  const int N = 202, K = 384, G = K / GS, W = K * BITS / 32;  // 202: a partial 4-column tile
  std::uniform_int_distribution<uint32_t> word;
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<uint32_t> w(size_t(N) * W);
  for (auto& v : w) v = word(rng);
  std::vector<S> scales(size_t(N) * G), biases(size_t(N) * G);
  for (auto& v : scales) v = S(0.01f * normal(rng));
  for (auto& v : biases) v = S(0.1f * normal(rng));
  int bad = 0;
  for (int M : {1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 17}) {
    std::vector<float> x(size_t(M) * K), want(size_t(M) * N), got(size_t(M) * N);
    for (auto& v : x) v = normal(rng);
    const lmspd::Floats xsum = lmspd::group_sums(x.data(), M, K, GS);
    lmspd::qmv_portable<BITS, GS, S>(x.data(), xsum.data(), w.data(), scales.data(), biases.data(), want.data(), M,
                                     N, K, 0, N);
#if defined(LMSPD_SIMD)
    // Two column ranges, as the pool's chunks split them.
    lmspd::qmv_simd<BITS, GS, S>(x.data(), xsum.data(), w.data(), scales.data(), biases.data(), got.data(), M, N, K,
                                 0, 100);
    lmspd::qmv_simd<BITS, GS, S>(x.data(), xsum.data(), w.data(), scales.data(), biases.data(), got.data(), M, N, K,
                                 100, N);
#else
    got = want;
#endif
    for (size_t i = 0; i < got.size(); ++i) bad += std::memcmp(&got[i], &want[i], sizeof(float)) != 0;
    ++cases;
  }
  return bad;
}

template <typename S>
int all(std::mt19937& rng, int& cases) {
  return check<2, 32, S>(rng, cases) + check<2, 64, S>(rng, cases) + check<2, 128, S>(rng, cases) +
         check<4, 32, S>(rng, cases) + check<4, 64, S>(rng, cases) + check<4, 128, S>(rng, cases) +
         check<8, 32, S>(rng, cases) + check<8, 64, S>(rng, cases) + check<8, 128, S>(rng, cases);
}

int main() {
  std::mt19937 rng(7);
  int cases = 0;
  const int bad = all<float>(rng, cases) + all<mx::float16_t>(rng, cases) + all<mx::bfloat16_t>(rng, cases);
#if defined(LMSPD_SIMD)
  std::printf("%s %d %d\n", lmspd::kSimd, cases, bad);
#else
  std::printf("portable %d %d\n", cases, bad);
#endif
  return bad != 0;
}
