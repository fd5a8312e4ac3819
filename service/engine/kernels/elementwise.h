// SwiGLU: mlx-lm's swiglu(gate, x) = silu(gate) * x = (gate * sigmoid(gate)) * x, bit for bit,
// in one primitive on both cores. LogSumExp: mx.logsumexp over the last axis (mlx-lm's sampling
// normalizes every step's logits by it), bit for bit, its rows on both cores.
//
// MLX's CPU unary ops run its simd functions one element at a time on Linux (Simd<float, 1>),
// and its exp there costs ~16 ns an element: a decode step's 30 swiglu calls of SmolLM2-135M
// took 0.87 ms at batch 1 and 11.6 at batch 8, and the logsumexp over a 49,152-token vocabulary
// 1.33 and 9.57 ms (docs/benchmarks.md, "The passes", the second). This computes each element
// with the same functions from MLX's headers (unary_ops.h's Sigmoid, simd::exp), each product
// rounded to float32 as MLX's separate multiplies are; on AVX2 eight elements at a time, by the
// same IEEE operations (exp8); the elements shared between the MLX stream thread and the Pool's
// helper.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <memory>
#include <stdexcept>
#include <vector>

#include "arrays.h"
#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/backend/cpu/unary_ops.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"
#include "no_contract.h"
#include "pool.h"
#include "simd.h"  // LMSPD_SIMD_AVX2, where exp8 is built

namespace lmspd {

#if defined(LMSPD_SIMD_AVX2)
// MLX's simd::exp (simd/math.h) for 8 floats at once, operation for operation: x * log2(e) in
// float; floor(x + 0.5) in double, as Simd<float, 1> + 0.5 promotes there; the polynomial by
// fused multiply-adds (std::fma, exactly rounded either way); 2^ipart by the exponent bits;
// the same selects for NaN and beyond +-88. Every step is one IEEE operation, so each lane is
// the scalar function's value.
inline __m256 exp8(__m256 x_init) {
  const __m256 x = _mm256_mul_ps(x_init, _mm256_set1_ps(1.442695f));
  const __m256d half = _mm256_set1_pd(0.5);
  const __m256d lo = _mm256_floor_pd(_mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(x)), half));
  const __m256d hi = _mm256_floor_pd(_mm256_add_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)), half));
  const __m256 ipart = _mm256_set_m128(_mm256_cvtpd_ps(hi), _mm256_cvtpd_ps(lo));
  const __m256 fpart = _mm256_sub_ps(x, ipart);
  __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
  p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(1.339887440266574e-3f));
  p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(9.618437357674640e-3f));
  p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(5.550332471162809e-2f));
  p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(2.402264791363012e-1f));
  p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(6.931472028550421e-1f));
  p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(1.000000000000000f));
  const __m256i epart = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(ipart), _mm256_set1_epi32(127)), 23);
  __m256 result = _mm256_mul_ps(_mm256_castsi256_ps(epart), p);
  result = _mm256_blendv_ps(result, x_init, _mm256_cmp_ps(x_init, x_init, _CMP_UNORD_Q));
  result = _mm256_blendv_ps(result, _mm256_set1_ps(std::numeric_limits<float>::infinity()),
                            _mm256_cmp_ps(x_init, _mm256_set1_ps(88.0f), _CMP_GT_OQ));
  return _mm256_blendv_ps(result, _mm256_setzero_ps(), _mm256_cmp_ps(x_init, _mm256_set1_ps(-88.0f), _CMP_LT_OQ));
}

// unary_ops.h's Sigmoid: 1 / (1 + exp(|x|)), then y below zero, 1 - y above.
inline __m256 sigmoid8(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 abs = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
  const __m256 y = _mm256_div_ps(one, _mm256_add_ps(one, exp8(abs)));
  return _mm256_blendv_ps(_mm256_sub_ps(one, y), y, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ));
}
#endif

LMSPD_NO_CONTRACT_ATTR inline void swiglu_range(const float* gate, const float* x, float* out, size_t i0, size_t i1) {
  LMSPD_NO_CONTRACT
  size_t i = i0;
#if defined(LMSPD_SIMD_AVX2)
  for (; i + 8 <= i1; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(g, sigmoid8(g)), _mm256_loadu_ps(x + i)));
  }
#endif
  using F = mlx::core::simd::Simd<float, 1>;
  mlx::core::detail::Sigmoid sigmoid;
  for (; i < i1; ++i) {
    const float s = sigmoid(F(gate[i])).value;
    const float silu = gate[i] * s;
    out[i] = silu * x[i];
  }
}

class SwiGLU : public mx::UnaryPrimitive {
 public:
  explicit SwiGLU(mx::Stream s) : mx::UnaryPrimitive(s) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = encoder_for(stream(), inputs, out);
    enc.dispatch([g = View(inputs[0]), x = View(inputs[1]), out = View(out)]() mutable {
      std::vector<float> g_copy, x_copy;
      const float *gp = rows_of(g, g_copy), *xp = rows_of(x, x_copy);
      float* op = out.data<float>();
      const size_t n = out.size();
      constexpr int kBlock = 1024;  // elements a chunk: a few microseconds
      const int blocks = static_cast<int>((n + kBlock - 1) / kBlock);
      pool().parallel_for(blocks, 2, [=](int b0, int b1) {
        swiglu_range(gp, xp, op, size_t(b0) * kBlock, std::min(n, size_t(b1) * kBlock));
      });
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("lmspd swiglu runs on the CPU only");
  }
  const char* name() const override { return "LmspdSwiGLU"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

// What MLX's CPU softmax and logsumexp (softmax.cpp, logsumexp.cpp with Simd<float, 1>) both
// do first: a row's maximum as simd::maximum keeps it (a NaN wins), then exp(x - max) of every
// element into e (which may be x), eight at a time where exp8 is (each lane simd::exp's value).
LMSPD_NO_CONTRACT_ATTR inline float max_and_exps(const float* x, int n, float* e) {
  LMSPD_NO_CONTRACT
  namespace simd = mlx::core::simd;
  using F = simd::Simd<float, 1>;
  F vmaximum(-std::numeric_limits<float>::infinity());
  for (int j = 0; j < n; ++j) vmaximum = simd::maximum(F(x[j]), vmaximum);
  const float maximum = simd::max(vmaximum);
  int j = 0;
#if defined(LMSPD_SIMD_AVX2)
  const __m256 vmax = _mm256_set1_ps(maximum);
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(e + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + j), vmax)));
#endif
  for (; j < n; ++j) e[j] = simd::exp(F(x[j]) - maximum).value;
  return maximum;
}

// The exponentials summed one after another from 0, as MLX's Simd<float, 1> accumulator does.
LMSPD_NO_CONTRACT_ATTR inline float sum_in_order(const float* e, int n) {
  LMSPD_NO_CONTRACT
  using F = mlx::core::simd::Simd<float, 1>;
  F vnormalizer(0.0);
  for (int j = 0; j < n; ++j) vnormalizer = vnormalizer + F(e[j]);
  return mlx::core::simd::sum(vnormalizer);
}

// MLX's CPU logsumexp of one contiguous row: log(sum) + max, or max itself when it is infinite.
inline float logsumexp_row(const float* x, int n, std::vector<float>& e) {
  e.resize(n);
  const float maximum = max_and_exps(x, n, e.data());
  const float normalizer = sum_in_order(e.data(), n);
  return std::isinf(maximum) ? maximum : std::log(normalizer) + maximum;
}

class LogSumExp : public mx::UnaryPrimitive {
 public:
  explicit LogSumExp(mx::Stream s) : mx::UnaryPrimitive(s) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.set_input_array(inputs[0]);
    enc.set_output_array(out);
    enc.dispatch([x = View(inputs[0]), out = View(out)]() mutable {
      std::vector<float> copy;
      const float* xp = rows_of(x, copy);
      float* op = out.data<float>();
      const int n = x.shape(-1);
      const int rows = static_cast<int>(out.size());
      pool().parallel_for(rows, 1, [=](int r0, int r1) {
        thread_local std::vector<float> e;
        for (int r = r0; r < r1; ++r) op[r] = logsumexp_row(xp + size_t(r) * n, n, e);
      });
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("lmspd logsumexp runs on the CPU only");
  }
  const char* name() const override { return "LmspdLogSumExp"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

// mlx-lm's swiglu(gate, x) for float32 arrays of one shape.
inline mx::array swiglu(const mx::array& gate, const mx::array& x) {
  if (gate.dtype() != mx::float32 || x.dtype() != mx::float32 || gate.shape() != x.shape())
    throw std::invalid_argument("gate and x must be float32 arrays of one shape");
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(x.shape(), mx::float32, std::make_shared<SwiGLU>(s), {gate, x});
}

// mx.logsumexp(x, axis=-1, keepdims=True) for float32 x with at least one element a row.
inline mx::array logsumexp(const mx::array& x) {
  if (x.dtype() != mx::float32 || x.ndim() < 1 || x.shape(-1) == 0)
    throw std::invalid_argument("x must be float32 with a last axis of at least one element");
  auto s = mx::default_stream(mx::Device::cpu);
  auto shape = x.shape();
  shape.back() = 1;
  return mx::array(shape, mx::float32, std::make_shared<LogSumExp>(s), {x});
}

}  // namespace lmspd
