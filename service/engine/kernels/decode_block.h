// CacheWrite and DecodeAttend: the middle of a decode step's attention layer in three primitives
// where mlx-lm's code builds fifteen, bit for bit.
//
// After the q/k/v products, mlx-lm's attention (models/llama.py, Attention.__call__) does, for
// one new position per sequence: three reshapes and three transposes, RoPE on q and on k, the
// KV cache's two slice updates (cache.update_and_fetch), two slices of the cache up to the new
// position, the attention, a transpose and a reshape: fifteen primitives a layer, 450 of a
// SmolLM2-135M step's 768, each with MLX's fixed cost per primitive and its Python call to
// build (docs/benchmarks.md, "Third pass"). Here:
//
//   CacheWrite    k (with RoPE from the tables: TableRope's rope_rows, rope.h) or v, written
//                 into the cache at the new position. The new cache takes over the old one's
//                 buffer when MLX says it may (is_donatable: nobody else holds it), as MLX's own
//                 SliceUpdate does, and otherwise starts as a copy. One output each, because
//                 MLX lets only a single-output primitive's input be donated.
//   DecodeAttend  RoPE on q, then Attention's one-row arithmetic (attention.h: attend) over the
//                 cache's first at + 1 positions, read through the strides the slice view had,
//                 so the BLAS calls are the same ones and give the same bits.
//   DecodeTail    DecodeAttend, then the rest of the block in the same task: o_proj with the
//                 residual add, the post-attention norm with gate and up, swiglu with down and
//                 the second residual add (quantized.h's product_rows and sibling_rows, as
//                 the four primitives it replaces compute them). One primitive where there were
//                 four: MLX's fixed cost per primitive, 8-11 us here, 90 times a step
//                 (docs/benchmarks.md, "Sixth pass").
//
// For one position, (B, 1, H * D) in memory is (B, H, 1, D): the reshapes and transposes
// change nothing there, which is why q, k, v and the output stay flat.
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <vector>

#include "arrays.h"
#include "attention.h"    // attend, Keys, MaskKind
#include "elementwise.h"  // swiglu_range
#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"
#include "norms.h"      // rms_norm_rows
#include "portable.h"   // Floats
#include "quantized.h"  // check, kernel_for, product_rows, sibling_rows, add_residual
#include "rope.h"       // rope_rows

namespace lmspd {

// RoPE's inputs for a row of positions: the tables and the offset (one, or one per sequence).
// The offset is read through its stride: a BatchKVCache's is a fresh sum every step, and
// wrapping it in a Contiguous node per call would be 60 primitives a step.
struct RopeArgs {
  const float* cos;
  const float* sin;
  std::vector<int32_t> offset;
  int positions, dims;
  bool traditional;
};
template <typename A>
RopeArgs rope_args(const A& cos, const A& sin, const A& offset, int dims, bool trad) {
  RopeArgs r{cos.template data<float>(), sin.template data<float>(), std::vector<int32_t>(offset.size()), cos.shape(0), dims, trad};
  const int32_t* o = offset.template data<int32_t>();
  const int64_t step = offset.ndim() == 0 ? 0 : offset.strides()[0];
  for (size_t i = 0; i < offset.size(); ++i) r.offset[i] = o[int64_t(i) * step];
  return r;
}

class CacheWrite : public mx::UnaryPrimitive {
 public:
  CacheWrite(mx::Stream s, int at, bool rope, int dims, bool traditional)
      : mx::UnaryPrimitive(s), at_(at), rope_(rope), dims_(dims), traditional_(traditional) {}

  // inputs: new (B, 1, heads * D), cache (B, heads, capacity, D)[, cos, sin, offset]
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const auto& cache = inputs[1];
    const bool taken = cache.is_donatable() && cache.flags().row_contiguous;
    if (taken)
      out.copy_shared_buffer(cache);
    else
      out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = encoder_for(stream(), inputs, out);
    std::vector<View> weak(inputs.begin(), inputs.end());
    weak.emplace_back(out);
    enc.dispatch([weak = std::move(weak), taken, at = at_, rope = rope_, dims = dims_, trad = traditional_]() mutable {
      const View& o = weak.back();
      const int B = o.shape(0), H = o.shape(1), cap = o.shape(2), D = o.shape(3);
      if (!taken) std::memcpy(o.data<float>(), weak[1].data<float>(), o.nbytes());  // row-contiguous: see below
      std::vector<float> copy, roped;
      const float* rows = rows_of(weak[0], copy);
      if (rope) {
        const RopeArgs r = rope_args(weak[2], weak[3], weak[4], dims, trad);
        roped.resize(size_t(B) * H * D);
        rope_rows(rows, r.cos, r.sin, r.offset.data(), int(r.offset.size()), roped.data(), B, H, 1, D, r.dims, r.positions,
                  r.traditional);
        rows = roped.data();
      }
      float* c = o.data<float>();
      for (size_t row = 0; row < size_t(B) * H; ++row)
        std::memcpy(c + (row * cap + at) * D, rows + row * D, sizeof(float) * D);
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("lmspd cache_write runs on the CPU only");
  }
  const char* name() const override { return "LmspdCacheWrite"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const CacheWrite&>(other);
    return at_ == o.at_ && rope_ == o.rope_ && dims_ == o.dims_ && traditional_ == o.traditional_;
  }

 private:
  int at_;
  bool rope_;
  int dims_;
  bool traditional_;
};

// A decode step's attention, as DecodeAttend runs it and DecodeTail first: RoPE on q, then
// attend over the caches' first at + 1 positions.
struct DecodeAttention {
  int at;
  float scale;
  int dims;
  bool traditional;
  int heads;
  MaskKind mask;
  bool operator==(const DecodeAttention&) const = default;

  // a: q, keys, values, cos, sin, offset, and the mask, when there is one, at a[mask_at]; into op
  // (B * heads rows of Dv).
  void run(const std::vector<View>& a, size_t mask_at, float* op) const {
    const View &q = a[0], &keys = a[1], &values = a[2];
    const int B = keys.shape(0), kvH = keys.shape(1), D = keys.shape(3);
    const RopeArgs r = rope_args(a[3], a[4], a[5], dims, traditional);
    std::vector<float> copy, qr(size_t(B) * heads * D);
    rope_rows(rows_of(q, copy), r.cos, r.sin, r.offset.data(), int(r.offset.size()), qr.data(), B, heads, 1, D, r.dims,
              r.positions, r.traditional);
    const Keys kv{keys.data<float>(), values.data<float>(), strides4(keys), strides4(values), kvH, at + 1,
                  values.shape(3)};
    const bool* mb = mask == MaskKind::kBool ? a[mask_at].data<bool>() : nullptr;
    const float* ma = mask == MaskKind::kAdd ? a[mask_at].data<float>() : nullptr;
    const std::array<int64_t, 4> ms = mask == MaskKind::kNone ? std::array<int64_t, 4>{} : broadcast_strides(a[mask_at]);
    attend(qr.data(), B, heads, D, kv, mask, mb, ma, ms, scale, op);
  }
};

class DecodeAttend : public mx::UnaryPrimitive {
 public:
  DecodeAttend(mx::Stream s, DecodeAttention attention) : mx::UnaryPrimitive(s), attention_(attention) {}

  // inputs: q (B, 1, H * D), keys, values (B, kvH, capacity, D or Dv), cos, sin, offset[, mask]
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.dispatch([weak = task_arrays(inputs, out, enc), attention = attention_]() mutable {
      attention.run(weak, 6, weak.back().data<float>());
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("lmspd decode_attend runs on the CPU only");
  }
  const char* name() const override { return "LmspdDecodeAttend"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return attention_ == static_cast<const DecodeAttend&>(other).attention_;
  }

 private:
  DecodeAttention attention_;
};

// One packed product's weights as DecodeTail reads them: inputs [first, first + 3) and its kernel.
struct Packed {
  int first, bits, group_size;
  Kernel kernel;
  const uint32_t* w(const std::vector<View>& in) const { return in[first].data<uint32_t>(); }
  const uint8_t* s(const std::vector<View>& in) const { return in[first + 1].data<uint8_t>(); }
  const uint8_t* b(const std::vector<View>& in) const { return in[first + 2].data<uint8_t>(); }
};

class DecodeTail : public mx::UnaryPrimitive {
 public:
  DecodeTail(mx::Stream s, DecodeAttention attention, std::array<int, 6> quant, std::vector<int> widths, float eps)
      : mx::UnaryPrimitive(s), attention_(attention), quant_(quant), widths_(std::move(widths)), eps_(eps) {}

  // inputs: q, keys, values, cos, sin, offset (as DecodeAttend's), x (the block's input, B, 1,
  // hidden), o_proj's w, scales, biases, the post-attention norm's weight, gate and up's stacked
  // w, scales, biases, down's w, scales, biases[, mask]
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    auto& enc = mx::cpu::get_command_encoder(stream());
    std::vector<View> weak = task_arrays(inputs, out, enc);
    const auto kernel = [&](int first, int q) {
      const Kernel k = kernel_for(quant_[q], quant_[q + 1], inputs[first + 1].dtype(), true, fast_);
      return Packed{first, quant_[q], quant_[q + 1], k};
    };
    const Packed o = kernel(7, 0), gate_up = kernel(11, 2), down = kernel(14, 4);
    enc.dispatch([weak = std::move(weak), attention = attention_, o, gate_up, down, widths = widths_,
                  eps = eps_]() mutable {
      const View& x = weak[6];
      const int B = x.shape(0), HDv = attention.heads * weak[2].shape(3), hidden = x.shape(-1), inner = widths[0];
      // DecodeAttend's arithmetic, into rows on a cache line for o_proj.
      lmspd::Floats attended(size_t(B) * HDv), h(size_t(B) * hidden), normed(size_t(B) * hidden);
      attention.run(weak, 17, attended.data());
      std::vector<float> copy;
      // o_proj, then x + it.
      product_rows(attended.data(), B, HDv, o.group_size, o.w(weak), o.s(weak), o.b(weak), h.data(), hidden,
                   o.kernel, true);
      add_residual(rows_of(x, copy), h.data(), h.size());
      // The norm, gate and up; swiglu, down, then h + it.
      rms_norm_rows(h.data(), weak[10].data<float>(), normed.data(), B, hidden, eps);
      lmspd::Floats gate(size_t(B) * inner), up(size_t(B) * inner), act(size_t(B) * inner);
      float* gates[] = {gate.data(), up.data()};
      sibling_rows(normed.data(), B, hidden, gate_up.group_size, gate_up.bits, gate_up.w(weak), gate_up.s(weak),
                   gate_up.b(weak), weak[12].itemsize(), widths, gates, gate_up.kernel, true);
      swiglu_range(gate.data(), up.data(), act.data(), 0, act.size());
      float* op = weak.back().data<float>();
      product_rows(act.data(), B, inner, down.group_size, down.w(weak), down.s(weak), down.b(weak), op, hidden,
                   down.kernel, true);
      add_residual(h.data(), op, h.size());
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("lmspd decode_tail runs on the CPU only");
  }
  const char* name() const override { return "LmspdDecodeTail"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const DecodeTail&>(other);
    return attention_ == o.attention_ && quant_ == o.quant_ && widths_ == o.widths_ && eps_ == o.eps_ &&
           fast_ == o.fast_;
  }

 private:
  DecodeAttention attention_;
  std::array<int, 6> quant_;  // bits and group size of o_proj, gate/up, down
  std::vector<int> widths_;   // gate's and up's
  float eps_;
  bool fast_ = built_fast();  // the numerics when its graph was built
};

inline void check_tables(const mx::array& cos, const mx::array& sin, const mx::array& offset, int dims, int D, int B) {
  if (cos.dtype() != mx::float32 || sin.dtype() != mx::float32 || dims % 2 != 0 || dims > D || dims <= 0 ||
      cos.ndim() != 2 || cos.shape(1) != dims / 2 || sin.shape() != cos.shape())
    throw std::invalid_argument("cos and sin must be float32 tables of (positions, dims / 2), dims even and <= D");
  if (offset.dtype() != mx::int32 || offset.ndim() > 1 || (offset.size() != 1 && int(offset.size()) != B))
    throw std::invalid_argument("offset must be int32, one or one per sequence");
}

// The cache (B, heads, capacity, D) with new (B, 1, heads * D) at position at, RoPE'd from the
// tables at offset when they are given (k), as it is when not (v).
inline mx::array cache_write(const mx::array& value, const mx::array& cache, int at, const std::optional<mx::array>& cos,
                             const std::optional<mx::array>& sin, const std::optional<mx::array>& offset, int dims,
                             bool traditional) {
  if (value.dtype() != mx::float32 || cache.dtype() != mx::float32 || cache.ndim() != 4 || value.ndim() != 3)
    throw std::invalid_argument("new must be float32 (B, 1, heads x D), the cache float32 (B, heads, capacity, D)");
  const int B = cache.shape(0), H = cache.shape(1), cap = cache.shape(2), D = cache.shape(3);
  if (value.shape() != mx::Shape{B, 1, H * D}) throw std::invalid_argument("new and the cache do not match");
  if (at < 0 || at >= cap) throw std::invalid_argument("at must be a position inside the cache");
  auto s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs = {value, row_contiguous(cache, s)};
  const bool rope = cos.has_value();
  if (rope) {
    if (!sin || !offset) throw std::invalid_argument("cos, sin and offset go together");
    check_tables(*cos, *sin, *offset, dims, D, B);
    inputs.push_back(row_contiguous(*cos, s));
    inputs.push_back(row_contiguous(*sin, s));
    inputs.push_back(*offset);
  }
  return mx::array(cache.shape(), mx::float32, std::make_shared<CacheWrite>(s, at, rope, dims, traditional), inputs);
}

// decode_attend's inputs, checked: q, keys, values, cos, sin, offset.
inline std::vector<mx::array> attend_inputs(const mx::array& q, const mx::array& keys, const mx::array& values,
                                            const mx::array& cos, const mx::array& sin, const mx::array& offset, int at,
                                            int dims, int heads) {
  if (q.dtype() != mx::float32 || keys.dtype() != mx::float32 || values.dtype() != mx::float32 || keys.ndim() != 4 ||
      values.ndim() != 4 || q.ndim() != 3)
    throw std::invalid_argument("q must be float32 (B, 1, heads x D), the caches float32 (B, heads, capacity, D)");
  const int B = keys.shape(0), kvH = keys.shape(1), cap = keys.shape(2), D = keys.shape(3), Dv = values.shape(3);
  if (heads <= 0 || heads % kvH != 0 || values.shape(0) != B || values.shape(1) != kvH || values.shape(2) != cap ||
      q.shape() != mx::Shape{B, 1, heads * D})
    throw std::invalid_argument("q and the caches do not match");
  if (at < 0 || at >= cap) throw std::invalid_argument("at must be a position inside the caches");
  check_tables(cos, sin, offset, dims, D, B);
  auto s = mx::default_stream(mx::Device::cpu);
  // The caches as they come (read through their strides, as the slice view was): they are the
  // cache_write outputs of this very step, not yet evaluated.
  std::vector<mx::array> inputs = {q, keys, values, row_contiguous(cos, s), row_contiguous(sin, s), offset};
  return inputs;
}

// The mask's kind, checked against (B, heads, 1, at + 1).
inline MaskKind mask_kind(const std::optional<mx::array>& mask, int B, int heads, int at) {
  if (!mask) return MaskKind::kNone;
  const auto& m = *mask;
  if (m.dtype() != mx::bool_ && m.dtype() != mx::float32) throw std::invalid_argument("mask must be bool or float32");
  const mx::Shape target = {B, heads, 1, at + 1};
  bool fits = m.ndim() <= 4;
  for (int d = 0; fits && d < m.ndim(); ++d) fits = m.shape(d) == 1 || m.shape(d) == target[4 - m.ndim() + d];
  if (!fits) throw std::invalid_argument("mask must broadcast to (B, H, 1, at + 1)");
  return m.dtype() == mx::bool_ ? MaskKind::kBool : MaskKind::kAdd;
}

// q (B, 1, heads * D) RoPE'd at offset, attending over the caches' first at + 1 positions;
// mask as attention takes it, over at + 1 keys. The output is (B, 1, heads * Dv).
inline mx::array decode_attend(const mx::array& q, const mx::array& keys, const mx::array& values, const mx::array& cos,
                               const mx::array& sin, const mx::array& offset, const std::optional<mx::array>& mask, int at,
                               float scale, int dims, bool traditional, int heads) {
  std::vector<mx::array> inputs = attend_inputs(q, keys, values, cos, sin, offset, at, dims, heads);
  const auto kind = mask_kind(mask, keys.shape(0), heads, at);
  if (mask) inputs.push_back(*mask);
  return mx::array({keys.shape(0), 1, heads * values.shape(3)}, mx::float32,
                   std::make_shared<DecodeAttend>(mx::default_stream(mx::Device::cpu),
                                                  DecodeAttention{at, scale, dims, traditional, heads, kind}),
                   inputs);
}

// decode_attend, then o_proj with x added, the post-attention norm (norm, eps) with gate and
// up (stacked: widths), swiglu with down and the second residual add: the block's output
// (B, 1, hidden), as decode_attend, quantized_matvec(residual=x), quantized_matvecs(norm=...)
// and quantized_matvec(up=..., residual=...) compute it. Each product: w, scales, biases,
// group size, bits, as quantized_matvec takes them.
inline mx::array decode_tail(const mx::array& q, const mx::array& keys, const mx::array& values, const mx::array& cos,
                             const mx::array& sin, const mx::array& offset, const std::optional<mx::array>& mask, int at,
                             float scale, int dims, bool traditional, int heads, const mx::array& x, const mx::array& o_w,
                             const mx::array& o_s, const mx::array& o_b, int o_gs, int o_bits, const mx::array& norm,
                             float eps, const mx::array& gu_w, const mx::array& gu_s, const mx::array& gu_b, int gu_gs,
                             int gu_bits, std::vector<int> widths, const mx::array& d_w, const mx::array& d_s,
                             const mx::array& d_b, int d_gs, int d_bits) {
  std::vector<mx::array> inputs = attend_inputs(q, keys, values, cos, sin, offset, at, dims, heads);
  const int B = keys.shape(0), Dv = values.shape(3);
  const auto kind = mask_kind(mask, B, heads, at);
  check(o_w, o_s, o_b, o_gs, o_bits);
  check(gu_w, gu_s, gu_b, gu_gs, gu_bits);
  check(d_w, d_s, d_b, d_gs, d_bits);
  if (x.dtype() != mx::float32 || x.ndim() != 3 || x.shape(0) != B || x.shape(1) != 1)
    throw std::invalid_argument("x must be float32 (B, 1, hidden)");
  const int hidden = x.shape(2);
  if (o_w.shape(0) != hidden || o_w.shape(1) * 32 / o_bits != heads * Dv)
    throw std::invalid_argument("o_proj must take the attention's heads x Dv to x's width");
  if (widths.size() != 2 || widths[0] != widths[1] || widths[0] <= 0 || gu_w.shape(0) != 2 * widths[0] ||
      gu_w.shape(1) * 32 / gu_bits != hidden)
    throw std::invalid_argument("gate and up must be two equal widths stacked, taking x's width");
  if (d_w.shape(0) != hidden || d_w.shape(1) * 32 / d_bits != widths[0])
    throw std::invalid_argument("down must take gate's width to x's width");
  if (norm.dtype() != mx::float32 || norm.ndim() != 1 || norm.shape(0) != hidden)
    throw std::invalid_argument("the norm's weight must be float32, 1-D and as wide as x");
  auto s = mx::default_stream(mx::Device::cpu);
  for (const auto& a : {o_w, o_s, o_b, norm, gu_w, gu_s, gu_b, d_w, d_s, d_b}) inputs.push_back(row_contiguous(a, s));
  inputs.insert(inputs.begin() + 6, x);
  if (mask) inputs.push_back(*mask);
  const std::array<int, 6> quant = {o_bits, o_gs, gu_bits, gu_gs, d_bits, d_gs};
  return mx::array({B, 1, hidden}, mx::float32,
                   std::make_shared<DecodeTail>(s, DecodeAttention{at, scale, dims, traditional, heads, kind}, quant,
                                                std::move(widths), eps),
                   inputs);
}

}  // namespace lmspd
