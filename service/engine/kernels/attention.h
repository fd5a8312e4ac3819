// DecodeAttention: mx.fast.scaled_dot_product_attention for one query row per sequence (a
// decode step), bit for bit, in one primitive.
//
// MLX's CPU backend has no attention kernel: the call builds its fallback graph (mlx/fast.cpp,
// the fallback lambda), a dozen primitives a layer (the scale's multiply, unflatten, expand,
// swap and broadcast views, two matmuls, the mask's select, softmax, flatten), run one after
// another on one core: step_profile's "attention" row (docs/benchmarks.md, "Step profile").
// This primitive runs the same arithmetic for each (sequence, head) on both cores:
//
//   1. q * scale, elementwise (float32, rounded: the fallback's multiply);
//   2. the scores, by the very cblas_sgemm call MLX's CPU matmul makes for that batch element
//      (mlx/backend/cpu/matmul.cpp and gemms/cblas.cpp: the same transpose flags and leading
//      dimensions, chosen from the same strides, or the same row-major copy when the strides
//      fit neither), so the BLAS computes the same bits: its summation order is its own;
//   3. a boolean mask's select (false: float32's lowest) or an additive mask's add;
//   4. softmax as MLX's CPU kernel computes it (mlx/backend/cpu/softmax.cpp, precise, float32:
//      the scalar path MLX takes on Linux, with its own simd::exp, included from its headers);
//   5. the output row, by MLX's cblas_sgemm call for scores @ v.
//
// The BLAS is whichever cblas_sgemm MLX's calls resolve to in this process (the engine loads
// OpenBLAS globally first, engine/upstream/blas.py; else the one bundled with MLX), because
// this extension links against the same libmlx and declares the symbol undefined, as libmlx does.
#pragma once

// Included by quantized.cpp, after MLX's headers, the mx alias, fused.h (rows_of), the Pool and
// elementwise.h (max_and_exps, sum_in_order: MLX's simd functions, from its headers).

#include <limits>

extern "C" void cblas_sgemm(int order, int trans_a, int trans_b, int M, int N, int K, float alpha, const float* A,
                            int lda, const float* B, int ldb, float beta, float* C, int ldc);

namespace {

constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;  // CBLAS_ORDER, CBLAS_TRANSPOSE

// One row x (1 x K) times the matrix MLX's matmul sees as b (K x N), given as its base pointer
// and its strides along K and N; as MLX's check_transpose chooses: row-major, column-major, or
// (neither) a row-major copy.
void row_times(const float* x, int K, const float* b, int64_t k_stride, int64_t n_stride, int N, float* out,
               std::vector<float>& scratch) {
  if (k_stride == N && n_stride == 1) {
    cblas_sgemm(kRowMajor, kNoTrans, kNoTrans, 1, N, K, 1.0f, x, K, b, N, 0.0f, out, N);
  } else if (k_stride == 1 && n_stride == K) {
    cblas_sgemm(kRowMajor, kNoTrans, kTrans, 1, N, K, 1.0f, x, K, b, K, 0.0f, out, N);
  } else {
    scratch.resize(size_t(K) * N);
    for (int k = 0; k < K; ++k)
      for (int n = 0; n < N; ++n) scratch[size_t(k) * N + n] = b[k * k_stride + n * n_stride];
    cblas_sgemm(kRowMajor, kNoTrans, kNoTrans, 1, N, K, 1.0f, x, K, scratch.data(), N, 0.0f, out, N);
  }
}

// MLX's CPU softmax of one contiguous row, in place (softmax.cpp with Simd<float, 1>, as on
// Linux): the exponentials of x - max (elementwise.h), their sum in order, each times 1 / sum.
LMSPD_NO_CONTRACT_ATTR void softmax_row(float* s, int n) {
  LMSPD_NO_CONTRACT
  max_and_exps(s, n, s);
  float normalizer = sum_in_order(s, n);
  normalizer = 1 / normalizer;
  for (int j = 0; j < n; ++j) s[j] = s[j] * normalizer;
}

// A mask's strides broadcast to (B, H, 1, Lk): 0 along its axes of size 1 and those it lacks.
std::array<int64_t, 4> broadcast_strides(const mx::array& m) {
  std::array<int64_t, 4> st = {0, 0, 0, 0};
  const int nd = m.ndim();
  for (int d = 0; d < nd; ++d)
    if (m.shape(d) != 1) st[4 - nd + d] = m.strides()[d];
  return st;
}

// The attention of B * H query rows (qp, D floats each, row u = b * H + h) over keys and values
// (B, kvH, Lk, D or Dv) given by base pointers and element strides, into op (B * H rows of Dv):
// DecodeAttention's arithmetic, which DecodeBlock (decode_block.h) shares.
enum class MaskKind { kNone = 0, kBool = 1, kAdd = 2 };
struct Keys {
  const float* k;
  const float* v;
  std::array<int64_t, 4> ks, vs;
  int kvH, Lk, Dv;
};
void attend(const float* qp, int B, int H, int D, const Keys& kv, MaskKind mask, const bool* mb, const float* ma,
            const std::array<int64_t, 4>& ms, float scale, float* op) {
  const int rep = H / kv.kvH, Lk = kv.Lk, Dv = kv.Dv;
  const float lowest = std::numeric_limits<float>::lowest();  // finfo(float32).min
  auto heads = [&](int u0, int u1) {
    thread_local std::vector<float> qs, scores, scratch;
    qs.resize(D);
    scores.resize(Lk);
    for (int u = u0; u < u1; ++u) {
      const int b = u / H, h = u % H, g = h / rep;
      const float* qr = qp + size_t(u) * D;
      for (int d = 0; d < D; ++d) qs[d] = scale * qr[d];
      // scores = (q * scale) @ swapaxes(k): b's K axis is k's last, its N axis k's rows
      row_times(qs.data(), D, kv.k + b * kv.ks[0] + g * kv.ks[1], kv.ks[3], kv.ks[2], Lk, scores.data(), scratch);
      if (mask != MaskKind::kNone) {
        const int64_t m0 = b * ms[0] + h * ms[1];
        for (int j = 0; j < Lk; ++j) {
          const int64_t at = m0 + j * ms[3];
          scores[j] = mb ? (mb[at] ? scores[j] : lowest) : scores[j] + ma[at];
        }
      }
      softmax_row(scores.data(), Lk);
      row_times(scores.data(), Lk, kv.v + b * kv.vs[0] + g * kv.vs[1], kv.vs[2], kv.vs[3], Dv, op + size_t(u) * Dv,
                scratch);
    }
  };
  pool().parallel_for(B * H, std::max(1, 1024 / std::max(1, Lk)), heads);
}

std::array<int64_t, 4> strides4(const mx::array& a) {
  return {a.strides()[0], a.strides()[1], a.strides()[2], a.strides()[3]};
}

class DecodeAttention : public mx::UnaryPrimitive {
 public:
  using Mask = MaskKind;
  static constexpr Mask kNone = MaskKind::kNone, kBool = MaskKind::kBool, kAdd = MaskKind::kAdd;
  DecodeAttention(mx::Stream s, float scale, Mask mask) : mx::UnaryPrimitive(s), scale_(scale), mask_(mask) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
    std::vector<mx::array> weak;
    for (const auto& a : inputs) weak.push_back(mx::array::unsafe_weak_copy(a));
    weak.push_back(mx::array::unsafe_weak_copy(out));
    enc.dispatch([weak = std::move(weak), scale = scale_, mask = mask_]() mutable {
      const mx::array &q = weak[0], &k = weak[1], &v = weak[2];
      std::vector<float> q_copy;
      const float* qp = rows_of(q, q_copy);
      const Keys kv{k.data<float>(), v.data<float>(), strides4(k), strides4(v), k.shape(1), k.shape(2), v.shape(3)};
      const bool* mb = mask == kBool ? weak[3].data<bool>() : nullptr;
      const float* ma = mask == kAdd ? weak[3].data<float>() : nullptr;
      const std::array<int64_t, 4> ms = mask == kNone ? std::array<int64_t, 4>{} : broadcast_strides(weak[3]);
      attend(qp, q.shape(0), q.shape(1), q.shape(3), kv, mask, mb, ma, ms, scale, weak.back().data<float>());
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("lmspd decode_attention runs on the CPU only");
  }
  const char* name() const override { return "LmspdDecodeAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const DecodeAttention&>(other);
    return scale_ == o.scale_ && mask_ == o.mask_;
  }

 private:
  float scale_;
  Mask mask_;
};

}  // namespace
