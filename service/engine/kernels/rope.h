// TableRope: mx.fast.rope on the CPU, bit for bit, in one primitive.
//
// MLX's CPU backend has no RoPE kernel: mx.fast.rope there builds its fallback graph, ~15
// primitives a call (positions, frequencies, cos, sin, slices, products, concatenation), and a
// decode step of SmolLM2-135M calls it 60 times (step_profile's "rope" row: 4-5 ms of a step).
// TableRope takes the fallback's own cos and sin for every position, computed once by MLX's
// ops (packed.py: the same ops on all positions at once, elementwise, so the same values), and
// does the rotation with the fallback's arithmetic, each product rounded to float32 before the
// sum: bit for bit mx.fast.rope (tested), in one primitive.
#pragma once

#include <cstdint>
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

// x: (B, H, T, D) row-contiguous; cs, sn: (P, dims / 2); offset: B positions, or one for all.
LMSPD_NO_CONTRACT_ATTR inline void rope_rows(const float* x, const float* cs, const float* sn, const int32_t* offset,
                                             int n_offsets, float* out, int B, int H, int T, int D, int dims, int P,
                                             bool traditional) {
  LMSPD_NO_CONTRACT
  const int half = dims / 2;
  for (int b = 0; b < B; ++b) {
    const int first = offset[n_offsets == 1 ? 0 : b];
    for (int h = 0; h < H; ++h)
      for (int t = 0; t < T; ++t) {
        const size_t row = ((size_t(b) * H + h) * T + t) * D;
        const float* xr = x + row;
        float* o = out + row;
        const int pos = first + t;
        if (pos < 0 || pos >= P) {  // past the tables: loudly wrong, never silently (packed.py guards)
          for (int d = 0; d < D; ++d) o[d] = __builtin_nanf("");
          continue;
        }
        const float* c = cs + size_t(pos) * half;
        const float* s = sn + size_t(pos) * half;
        for (int i = 0; i < half; ++i) {
          const float x1 = traditional ? xr[2 * i] : xr[i];
          const float x2 = traditional ? xr[2 * i + 1] : xr[i + half];
          const float a = x1 * c[i], bb = x2 * s[i], e = x1 * s[i], f = x2 * c[i];
          o[traditional ? 2 * i : i] = a - bb;
          o[traditional ? 2 * i + 1 : i + half] = e + f;
        }
        for (int d = dims; d < D; ++d) o[d] = xr[d];
      }
  }
}

class TableRope : public mx::UnaryPrimitive {
 public:
  TableRope(mx::Stream s, int dims, bool traditional) : mx::UnaryPrimitive(s), dims_(dims), traditional_(traditional) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const auto& x = inputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = encoder_for(stream(), inputs, out);
    const int D = x.shape(-1), T = x.shape(-2), H = x.shape(-3), B = static_cast<int>(x.size() / (D * T * H));
    const int P = inputs[1].shape(0), n_offsets = static_cast<int>(inputs[3].size());
    enc.dispatch([x = View(x), c = View(inputs[1]), s = View(inputs[2]), off = View(inputs[3]), out = View(out), B,
                  H, T, D, P, n_offsets, dims = dims_, trad = traditional_]() mutable {
      std::vector<float> copy;
      rope_rows(rows_of(x, copy), c.data<float>(), s.data<float>(), off.data<int32_t>(), n_offsets, out.data<float>(),
                B, H, T, D, dims, P, trad);
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("lmspd rope runs on the CPU only");
  }
  const char* name() const override { return "LmspdTableRope"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const TableRope&>(other);
    return dims_ == o.dims_ && traditional_ == o.traditional_;
  }

 private:
  int dims_;
  bool traditional_;
};

// x rotated by the tables' angles at positions offset + t (offset: one, or one per batch row).
inline mx::array rope(const mx::array& x, const mx::array& cos, const mx::array& sin, const mx::array& offset, int dims,
                      bool traditional) {
  if (x.dtype() != mx::float32 || x.ndim() < 3 || dims % 2 != 0 || dims > x.shape(-1))
    throw std::invalid_argument("x must be float32 with at least 3 dimensions, dims even and <= its last");
  if (cos.dtype() != mx::float32 || cos.ndim() != 2 || cos.shape(1) != dims / 2 || sin.shape() != cos.shape() ||
      sin.dtype() != mx::float32)
    throw std::invalid_argument("cos and sin must be float32 tables of (positions, dims / 2)");
  if (offset.dtype() != mx::int32 || offset.ndim() > 1 || (offset.size() != 1 && offset.size() != x.size() / (x.shape(-1) * x.shape(-2) * x.shape(-3))))
    throw std::invalid_argument("offset must be int32, one or one per batch row");
  auto s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs = {x, row_contiguous(cos, s), row_contiguous(sin, s),
                                   row_contiguous(offset, s)};
  return mx::array(x.shape(), mx::float32, std::make_shared<TableRope>(s, dims, traditional), inputs);
}

}  // namespace lmspd
