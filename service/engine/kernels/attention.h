// Attention: mx.fast.scaled_dot_product_attention, bit for bit, in one primitive: a decode
// step's one query row per sequence, and a prompt's many (causal, or under a batch's mask).
//
// MLX's CPU backend has no attention kernel: the call builds its fallback graph (mlx/fast.cpp,
// the fallback lambda), a dozen primitives a layer (the scale's multiply, unflatten, expand,
// swap and broadcast views, two matmuls, the mask's select, softmax, flatten), run one after
// another on one core: 3.64 ms a step at batch 1 (docs/benchmarks.md, "The passes", the second). At
// a prompt the fallback's softmax dominates: one scalar exp per score (~16 ns on Linux), 9 heads
// x 512 rows x every key, a layer. This primitive runs the same arithmetic:
//
//   1. q * scale, elementwise (float32, rounded: the fallback's multiply);
//   2. the scores, by the very cblas_sgemm call MLX's CPU matmul makes for that batch element
//      (mlx/backend/cpu/matmul.cpp and gemms/cblas.cpp: one call per (sequence, head), M the
//      query rows, the same transpose flags and leading dimensions, chosen from the same
//      strides, or the same row-major copy when the strides fit neither), so the BLAS computes
//      the same bits: its summation order is its own;
//   3. a boolean mask's select (false: float32's lowest), an additive mask's add, or the causal
//      mask the fallback builds (query row i sees keys j <= i + keys - rows);
//   4. softmax as MLX's CPU kernel computes it (mlx/backend/cpu/softmax.cpp, precise, float32:
//      the scalar path MLX takes on Linux, with its own simd::exp, included from its headers),
//      eight lanes at a time (elementwise.h);
//   5. the output rows, by MLX's cblas_sgemm call for scores @ v.
//
// One query row: each (sequence, head) on both cores. Many: the heads one after another, each
// product one BLAS call as MLX makes it (threaded inside the BLAS), the mask and softmax rows on
// both cores; the scores of one head at a time, never the fallback's three copies of all of them.
//
// The BLAS is whichever cblas_sgemm MLX's calls resolve to in this process (the engine loads
// OpenBLAS globally first, engine/upstream/blas.py; else the one bundled with MLX), because
// this extension links against the same libmlx and declares the symbol undefined, as libmlx does.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <vector>

#include "arrays.h"
#include "elementwise.h"  // max_and_exps, sum_in_order: MLX's simd functions, from its headers
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"
#include "no_contract.h"
#include "pool.h"

extern "C" void cblas_sgemm(int order, int trans_a, int trans_b, int M, int N, int K, float alpha, const float* A,
                            int lda, const float* B, int ldb, float beta, float* C, int ldc);

namespace lmspd {

constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;  // CBLAS_ORDER, CBLAS_TRANSPOSE

// Rows x (M x K, row-major) times the matrix MLX's matmul sees as b (K x N), given as its base
// pointer and its strides along K and N; as MLX's check_transpose chooses: row-major,
// column-major, or (neither) a row-major copy.
inline void rows_times(const float* x, int M, int K, const float* b, int64_t k_stride, int64_t n_stride, int N,
                       float* out, std::vector<float>& scratch) {
  if (k_stride == N && n_stride == 1) {
    cblas_sgemm(kRowMajor, kNoTrans, kNoTrans, M, N, K, 1.0f, x, K, b, N, 0.0f, out, N);
  } else if (k_stride == 1 && n_stride == K) {
    cblas_sgemm(kRowMajor, kNoTrans, kTrans, M, N, K, 1.0f, x, K, b, K, 0.0f, out, N);
  } else {
    scratch.resize(size_t(K) * N);
    for (int k = 0; k < K; ++k)
      for (int n = 0; n < N; ++n) scratch[size_t(k) * N + n] = b[k * k_stride + n * n_stride];
    cblas_sgemm(kRowMajor, kNoTrans, kNoTrans, M, N, K, 1.0f, x, K, scratch.data(), N, 0.0f, out, N);
  }
}
inline void row_times(const float* x, int K, const float* b, int64_t k_stride, int64_t n_stride, int N, float* out,
                      std::vector<float>& scratch) {
  rows_times(x, 1, K, b, k_stride, n_stride, N, out, scratch);
}

// MLX's CPU softmax of one contiguous row, in place (softmax.cpp with Simd<float, 1>, as on
// Linux): the exponentials of x - max (elementwise.h), their sum in order, each times 1 / sum.
LMSPD_NO_CONTRACT_ATTR inline void softmax_row(float* s, int n) {
  LMSPD_NO_CONTRACT
  max_and_exps(s, n, s);
  float normalizer = sum_in_order(s, n);
  normalizer = 1 / normalizer;
  for (int j = 0; j < n; ++j) s[j] = s[j] * normalizer;
}

// A mask's strides broadcast to (B, H, L, Lk): 0 along its axes of size 1 and those it lacks.
template <typename A>
std::array<int64_t, 4> broadcast_strides(const A& m) {
  std::array<int64_t, 4> st = {0, 0, 0, 0};
  const int nd = m.ndim();
  for (int d = 0; d < nd; ++d)
    if (m.shape(d) != 1) st[4 - nd + d] = m.strides()[d];
  return st;
}

// A mask array's row applied to one row of scores, as the fallback does: a boolean mask's select
// (false: float32's lowest) or an additive mask's add; m0 the row's first element, step its stride.
inline void mask_row(float* s, int Lk, const bool* mb, const float* ma, int64_t m0, int64_t step) {
  const float lowest = std::numeric_limits<float>::lowest();  // finfo(float32).min
  for (int j = 0; j < Lk; ++j) {
    const int64_t at = m0 + j * step;
    s[j] = mb ? (mb[at] ? s[j] : lowest) : s[j] + ma[at];
  }
}

// The attention of B * H query rows (qp, D floats each, row u = b * H + h) over keys and values
// (B, kvH, Lk, D or Dv) given by base pointers and element strides, into op (B * H rows of Dv):
// Attention's arithmetic for one row, which DecodeBlock (decode_block.h) shares.
enum class MaskKind { kNone = 0, kBool = 1, kAdd = 2, kCausal = 3 };
struct Keys {
  const float* k;
  const float* v;
  std::array<int64_t, 4> ks, vs;
  int kvH, Lk, Dv;
};
inline void attend(const float* qp, int B, int H, int D, const Keys& kv, MaskKind mask, const bool* mb, const float* ma,
                   const std::array<int64_t, 4>& ms, float scale, float* op) {
  const int rep = H / kv.kvH, Lk = kv.Lk, Dv = kv.Dv;
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
      if (mask != MaskKind::kNone) mask_row(scores.data(), Lk, mb, ma, b * ms[0] + h * ms[1], ms[3]);
      softmax_row(scores.data(), Lk);
      row_times(scores.data(), Lk, kv.v + b * kv.vs[0] + g * kv.vs[1], kv.vs[2], kv.vs[3], Dv, op + size_t(u) * Dv,
                scratch);
    }
  };
  pool().parallel_for(B * H, std::max(1, 1024 / std::max(1, Lk)), heads);
}

// The attention of L query rows for each of B * H (sequence, head) pairs (qp: B * H * L rows of
// D floats, row-contiguous) into op (the same rows of Dv): mask kCausal is the fallback's causal
// mask, the others as attend's, with ms's third stride along the query rows.
inline void attend_rows(const float* qp, int B, int H, int L, int D, const Keys& kv, MaskKind mask, const bool* mb,
                        const float* ma, const std::array<int64_t, 4>& ms, float scale, float* op) {
  const int rep = H / kv.kvH, Lk = kv.Lk, Dv = kv.Dv, offset = Lk - L;
  const float lowest = std::numeric_limits<float>::lowest();
  std::vector<float> qs(size_t(L) * D), scores(size_t(L) * Lk), scratch;
  for (int u = 0; u < B * H; ++u) {
    const int b = u / H, h = u % H, g = h / rep;
    const float* qr = qp + size_t(u) * L * D;
    for (size_t i = 0; i < qs.size(); ++i) qs[i] = scale * qr[i];
    rows_times(qs.data(), L, D, kv.k + b * kv.ks[0] + g * kv.ks[1], kv.ks[3], kv.ks[2], Lk, scores.data(), scratch);
    pool().parallel_for(L, std::max(1, 4096 / std::max(1, Lk)), [&](int i0, int i1) {
      for (int i = i0; i < i1; ++i) {
        float* s = scores.data() + size_t(i) * Lk;
        if (mask == MaskKind::kCausal) {
          for (int j = std::max(0, offset + i + 1); j < Lk; ++j) s[j] = lowest;
        } else if (mask != MaskKind::kNone) {
          mask_row(s, Lk, mb, ma, b * ms[0] + h * ms[1] + i * ms[2], ms[3]);
        }
        softmax_row(s, Lk);
      }
    });
    rows_times(scores.data(), L, Lk, kv.v + b * kv.vs[0] + g * kv.vs[1], kv.vs[2], kv.vs[3], Dv,
               op + size_t(u) * L * Dv, scratch);
  }
}

// The attention of L query rows, each as one decoding step computes it: row i of a sequence
// sees the first Lk - L + i + 1 keys, and attend's arithmetic runs over exactly those (one
// BLAS row, the softmax over that many scores): a chunk's rows then carry the bits the same
// tokens decoded one at a time would, so a verified draft (engine/speculation.py) or a
// resumed suffix continues exactly as decoding would (docs/numerics.md). Rows as attend_rows'.
inline void attend_each_row(const float* qp, int B, int H, int L, int D, const Keys& kv, MaskKind mask, const bool* mb,
                            const float* ma, const std::array<int64_t, 4>& ms, float scale, float* op) {
  const int rep = H / kv.kvH, Dv = kv.Dv, offset = kv.Lk - L;
  auto rows = [&](int r0, int r1) {
    thread_local std::vector<float> qs, scores, scratch;
    qs.resize(D);
    scores.resize(kv.Lk);
    for (int r = r0; r < r1; ++r) {
      const int u = r / L, i = r % L, b = u / H, h = u % H, g = h / rep, Lk = offset + i + 1;
      const float* qr = qp + size_t(r) * D;
      for (int d = 0; d < D; ++d) qs[d] = scale * qr[d];
      row_times(qs.data(), D, kv.k + b * kv.ks[0] + g * kv.ks[1], kv.ks[3], kv.ks[2], Lk, scores.data(), scratch);
      if (mask == MaskKind::kBool || mask == MaskKind::kAdd)
        mask_row(scores.data(), Lk, mb, ma, b * ms[0] + h * ms[1] + i * ms[2], ms[3]);
      softmax_row(scores.data(), Lk);
      row_times(scores.data(), Lk, kv.v + b * kv.vs[0] + g * kv.vs[1], kv.vs[2], kv.vs[3], Dv, op + size_t(r) * Dv,
                scratch);
    }
  };
  pool().parallel_for(B * H * L, std::max(1, 1024 / std::max(1, kv.Lk)), rows);
}

// Whether a boolean mask hides from each query row every key after its own position (a causal
// mask, with a batch's left padding): then attend_each_row computes what the mask asks.
inline bool masks_the_future(const bool* mb, const std::array<int64_t, 4>& ms, int B, int H, int L, int Lk) {
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < (ms[1] == 0 ? 1 : H); ++h)
      for (int i = 0; i < L; ++i)
        for (int j = Lk - L + i + 1; j < Lk; ++j)
          if (mb[b * ms[0] + h * ms[1] + i * ms[2] + j * ms[3]]) return false;
  return true;
}

template <typename A>
std::array<int64_t, 4> strides4(const A& a) {
  return {a.strides()[0], a.strides()[1], a.strides()[2], a.strides()[3]};
}

class Attention : public mx::UnaryPrimitive {
 public:
  using Mask = MaskKind;
  static constexpr Mask kNone = MaskKind::kNone, kBool = MaskKind::kBool, kAdd = MaskKind::kAdd,
                        kCausal = MaskKind::kCausal;
  Attention(mx::Stream s, float scale, Mask mask, bool each_row)
      : mx::UnaryPrimitive(s), scale_(scale), mask_(mask), each_row_(each_row) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.dispatch([weak = task_arrays(inputs, out, enc), scale = scale_, mask = mask_, each_row = each_row_]() mutable {
      const View &q = weak[0], &k = weak[1], &v = weak[2];
      std::vector<float> q_copy;
      const float* qp = rows_of(q, q_copy);
      const Keys kv{k.data<float>(), v.data<float>(), strides4(k), strides4(v), k.shape(1), k.shape(2), v.shape(3)};
      const bool* mb = mask == kBool ? weak[3].data<bool>() : nullptr;
      const float* ma = mask == kAdd ? weak[3].data<float>() : nullptr;
      const bool arr = mask == kBool || mask == kAdd;
      const std::array<int64_t, 4> ms = arr ? broadcast_strides(weak[3]) : std::array<int64_t, 4>{};
      float* op = weak.back().data<float>();
      const int B = q.shape(0), H = q.shape(1), L = q.shape(2), D = q.shape(3);
      if (L == 1)  // one row: the causal mask masks nothing
        attend(qp, B, H, D, kv, arr ? mask : kNone, mb, ma, ms, scale, op);
      else if (each_row && (mask == kCausal || (mask == kBool && masks_the_future(mb, ms, B, H, L, kv.Lk))))
        attend_each_row(qp, B, H, L, D, kv, mask, mb, ma, ms, scale, op);
      else
        attend_rows(qp, q.shape(0), q.shape(1), q.shape(2), q.shape(3), kv, mask, mb, ma, ms, scale, op);
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("lmspd attention runs on the CPU only");
  }
  const char* name() const override { return "LmspdAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Attention&>(other);
    return scale_ == o.scale_ && mask_ == o.mask_ && each_row_ == o.each_row_;
  }

 private:
  float scale_;
  Mask mask_;
  bool each_row_;
};

// mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask): q (B, H, L, D), k (B,
// kvH, Lk, D), v (B, kvH, Lk, Dv), float32; mask None, bool or float32, broadcastable to (B, H,
// L, Lk), or (causal) the fallback's causal mask. each_row: a causal call's rows (or a boolean
// mask's that hides every row's future) each as a decoding step computes it (attend_each_row),
// where the fallback computes them all in one BLAS call, with other bits.
inline mx::array attention(const mx::array& q, const mx::array& k, const mx::array& v,
                           const std::optional<mx::array>& mask, float scale, bool causal, bool each_row) {
  const bool f32 = q.dtype() == mx::float32 && k.dtype() == mx::float32 && v.dtype() == mx::float32;
  if (!f32 || q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4 || q.shape(2) == 0)
    throw std::invalid_argument("q, k and v must be 4-D float32, with query rows");
  if (k.shape(0) != q.shape(0) || v.shape(0) != q.shape(0) || k.shape(3) != q.shape(3) || v.shape(1) != k.shape(1) ||
      v.shape(2) != k.shape(2) || k.shape(1) == 0 || q.shape(1) % k.shape(1) != 0)
    throw std::invalid_argument("q, k and v do not match");
  if (causal && (mask || q.shape(2) > k.shape(2)))
    throw std::invalid_argument("a causal mask takes no mask array, and no more query rows than keys");
  auto s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs = {q, k, v};
  auto kind = causal ? Attention::kCausal : Attention::kNone;
  if (mask) {
    const auto& m = *mask;
    if (m.dtype() != mx::bool_ && m.dtype() != mx::float32) throw std::invalid_argument("mask must be bool or float32");
    const mx::Shape target = {q.shape(0), q.shape(1), q.shape(2), k.shape(2)};
    bool fits = m.ndim() <= 4;
    for (int d = 0; fits && d < m.ndim(); ++d) fits = m.shape(d) == 1 || m.shape(d) == target[4 - m.ndim() + d];
    if (!fits) throw std::invalid_argument("mask must broadcast to (B, H, L, keys)");
    kind = m.dtype() == mx::bool_ ? Attention::kBool : Attention::kAdd;
    inputs.push_back(m);
  }
  return mx::array({q.shape(0), q.shape(1), q.shape(2), v.shape(3)}, mx::float32,
                   std::make_shared<Attention>(s, scale, kind, each_row), inputs);
}

}  // namespace lmspd
