// RmsNorm: mx.fast.rms_norm on the CPU, bit for bit, in one primitive where MLX's CPU backend
// builds its fallback graph (it has no kernels for its fast ops, and a decode step's many small
// calls are dispatch-bound: bench/step_profile.py).
#pragma once

#include <cmath>
#include <cstddef>
#include <memory>
#include <stdexcept>
#include <vector>

#include "arrays.h"
#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"
#include "no_contract.h"

namespace lmspd {

// RMSNorm as mx.fast.rms_norm's CPU fallback computes it, for float32 x and weight: per row,
// the squares x * x summed one after another from 0 (MLX's CPU sum reduction of a contiguous
// row), times 1 / D as float32, plus eps, then 1 / sqrt of that; each x times it, then times
// the weight, every product rounded. Two primitives of the fallback's eight per call, 61 calls a
// SmolLM2 decode step.
LMSPD_NO_CONTRACT_ATTR inline void rms_norm_rows(const float* x, const float* w, float* out, size_t rows, int D,
                                                 float eps) {
  LMSPD_NO_CONTRACT
  const float inv_d = static_cast<float>(1.0 / D);
  for (size_t r = 0; r < rows; ++r) {
    const float* xr = x + r * D;
    float* o = out + r * D;
    float sum = 0.f;
    for (int i = 0; i < D; ++i) {
      const float sq = xr[i] * xr[i];
      sum = sum + sq;
    }
    const float mean = sum * inv_d;
    const float scale = 1.0f / std::sqrt(mean + eps);
    for (int i = 0; i < D; ++i) {
      const float normed = xr[i] * scale;
      o[i] = normed * w[i];
    }
  }
}

class RmsNorm : public mx::UnaryPrimitive {
 public:
  RmsNorm(mx::Stream s, float eps) : mx::UnaryPrimitive(s), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const auto& x = inputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = encoder_for(stream(), inputs, out);
    const int D = x.shape(-1);
    enc.dispatch([x = View(x), w = View(inputs[1]), out = View(out), D, eps = eps_]() mutable {
      std::vector<float> copy;
      rms_norm_rows(rows_of(x, copy), w.data<float>(), out.data<float>(), x.size() / D, D, eps);
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("lmspd rms_norm runs on the CPU only");
  }
  const char* name() const override { return "LmspdRmsNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const RmsNorm&>(other).eps_;
  }

 private:
  float eps_;
};

// mx.fast.rms_norm(x, weight, eps) for float32 x and weight.
inline mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps) {
  if (x.dtype() != mx::float32 || weight.dtype() != mx::float32 || x.ndim() < 1 || weight.ndim() != 1 ||
      weight.shape(0) != x.shape(-1))
    throw std::invalid_argument("x and weight must be float32, the weight 1-D and as wide as x");
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(x.shape(), mx::float32, std::make_shared<RmsNorm>(s, eps),
                   {x, row_contiguous(weight, s)});
}

}  // namespace lmspd
