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
//   CacheWrite    k (with RoPE from the tables: TableRope's rope_rows, fused.h) or v, written
//                 into the cache at the new position. The new cache takes over the old one's
//                 buffer when MLX says it may (is_donatable: nobody else holds it), as MLX's own
//                 SliceUpdate does, and otherwise starts as a copy. One output each, because
//                 MLX lets only a single-output primitive's input be donated.
//   DecodeAttend  RoPE on q, then Attention's one-row arithmetic (attention.h: attend) over the
//                 cache's first at + 1 positions, read through the strides the slice view had,
//                 so the BLAS calls are the same ones and give the same bits.
//
// For one position, (B, 1, H * D) in memory is (B, H, 1, D): the reshapes and transposes
// change nothing there, which is why q, k, v and the output stay flat.
#pragma once

// Included by quantized.cpp, after fused.h (rope_rows, rows_of), attention.h and row_contiguous.

namespace {

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
RopeArgs rope_args(const mx::array& cos, const mx::array& sin, const mx::array& offset, int dims, bool trad) {
  RopeArgs r{cos.data<float>(), sin.data<float>(), std::vector<int32_t>(offset.size()), cos.shape(0), dims, trad};
  const int32_t* o = offset.data<int32_t>();
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
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
    std::vector<mx::array> weak;
    for (const auto& a : inputs) weak.push_back(mx::array::unsafe_weak_copy(a));
    weak.push_back(mx::array::unsafe_weak_copy(out));
    enc.dispatch([weak = std::move(weak), taken, at = at_, rope = rope_, dims = dims_, trad = traditional_]() mutable {
      mx::array& o = weak.back();
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

class DecodeAttend : public mx::UnaryPrimitive {
 public:
  DecodeAttend(mx::Stream s, int at, float scale, int dims, bool traditional, int heads, MaskKind mask)
      : mx::UnaryPrimitive(s), at_(at), scale_(scale), dims_(dims), traditional_(traditional), heads_(heads), mask_(mask) {}

  // inputs: q (B, 1, H * D), keys, values (B, kvH, capacity, D or Dv), cos, sin, offset[, mask]
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
    std::vector<mx::array> weak;
    for (const auto& a : inputs) weak.push_back(mx::array::unsafe_weak_copy(a));
    weak.push_back(mx::array::unsafe_weak_copy(out));
    enc.dispatch([weak = std::move(weak), at = at_, scale = scale_, dims = dims_, trad = traditional_, H = heads_,
                  mask = mask_]() mutable {
      const mx::array &q = weak[0], &keys = weak[1], &values = weak[2];
      const int B = keys.shape(0), kvH = keys.shape(1), D = keys.shape(3);
      const RopeArgs r = rope_args(weak[3], weak[4], weak[5], dims, trad);
      std::vector<float> copy, qr(size_t(B) * H * D);
      rope_rows(rows_of(q, copy), r.cos, r.sin, r.offset.data(), int(r.offset.size()), qr.data(), B, H, 1, D, r.dims, r.positions,
                r.traditional);
      const Keys kv{keys.data<float>(), values.data<float>(), strides4(keys), strides4(values), kvH, at + 1,
                    values.shape(3)};
      const bool* mb = mask == MaskKind::kBool ? weak[6].data<bool>() : nullptr;
      const float* ma = mask == MaskKind::kAdd ? weak[6].data<float>() : nullptr;
      const std::array<int64_t, 4> ms = mask == MaskKind::kNone ? std::array<int64_t, 4>{} : broadcast_strides(weak[6]);
      attend(qr.data(), B, H, D, kv, mask, mb, ma, ms, scale, weak.back().data<float>());
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("lmspd decode_attend runs on the CPU only");
  }
  const char* name() const override { return "LmspdDecodeAttend"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const DecodeAttend&>(other);
    return at_ == o.at_ && scale_ == o.scale_ && dims_ == o.dims_ && traditional_ == o.traditional_ &&
           heads_ == o.heads_ && mask_ == o.mask_;
  }

 private:
  int at_;
  float scale_;
  int dims_;
  bool traditional_;
  int heads_;
  MaskKind mask_;
};

void check_tables(const mx::array& cos, const mx::array& sin, const mx::array& offset, int dims, int D, int B) {
  if (cos.dtype() != mx::float32 || sin.dtype() != mx::float32 || dims % 2 != 0 || dims > D || dims <= 0 ||
      cos.ndim() != 2 || cos.shape(1) != dims / 2 || sin.shape() != cos.shape())
    throw std::invalid_argument("cos and sin must be float32 tables of (positions, dims / 2), dims even and <= D");
  if (offset.dtype() != mx::int32 || offset.ndim() > 1 || (offset.size() != 1 && int(offset.size()) != B))
    throw std::invalid_argument("offset must be int32, one or one per sequence");
}

// The cache (B, heads, capacity, D) with new (B, 1, heads * D) at position at, RoPE'd from the
// tables at offset when they are given (k), as it is when not (v).
mx::array cache_write(const mx::array& value, const mx::array& cache, int at, const std::optional<mx::array>& cos,
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

// q (B, 1, heads * D) RoPE'd at offset, attending over the caches' first at + 1 positions;
// mask as attention takes it, over at + 1 keys. The output is (B, 1, heads * Dv).
mx::array decode_attend(const mx::array& q, const mx::array& keys, const mx::array& values, const mx::array& cos,
                        const mx::array& sin, const mx::array& offset, const std::optional<mx::array>& mask, int at,
                        float scale, int dims, bool traditional, int heads) {
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
  auto kind = MaskKind::kNone;
  if (mask) {
    const auto& m = *mask;
    if (m.dtype() != mx::bool_ && m.dtype() != mx::float32) throw std::invalid_argument("mask must be bool or float32");
    const mx::Shape target = {B, heads, 1, at + 1};
    bool fits = m.ndim() <= 4;
    for (int d = 0; fits && d < m.ndim(); ++d) fits = m.shape(d) == 1 || m.shape(d) == target[4 - m.ndim() + d];
    if (!fits) throw std::invalid_argument("mask must broadcast to (B, H, 1, at + 1)");
    kind = m.dtype() == mx::bool_ ? MaskKind::kBool : MaskKind::kAdd;
    inputs.push_back(m);
  }
  return mx::array({B, 1, heads * Dv}, mx::float32,
                   std::make_shared<DecodeAttend>(s, at, scale, dims, traditional, heads, kind), inputs);
}

}  // namespace
