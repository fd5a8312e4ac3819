// lmspd's CPU kernels for MLX's affine-quantized weights, with float32 activations.
//
// MLX's CPU backend has a quantized matmul, but it is single-threaded and unpacks every
// weight once per row: on a 576x1536 layer it takes 1.1 ms for one row where float32 BLAS
// takes 0.3 ms, which is why lmspd used to run quantized models with dense float32 weights
// (8x their memory). These two primitives let the weights stay packed:
//
//   quantized_matvec  x @ dequantize(w).T for the few rows of a decode step: each group of
//                     weights is unpacked once for all rows, summed in float32 vectors.
//   dequantize        the float32 weights, for a prefill's many rows to go through BLAS.
//
// Both take each weight as the exact affine value scale * q + bias, evaluated in float32 from
// the stored scales and biases (float32, float16 or bfloat16, read as they are): the product
// is exact, the sum rounded once: the exact path (numerics = "fast" gives 4-bit weights' products
// 8-bit activations instead: q8.h, docs/numerics.md). With float32 scales that is
// mx.dequantize's output bit for bit (no fused multiply-add); with 16-bit scales mx.dequantize rounds the product and the sum
// again to 16 bits, which these kernels do not (the values differ by at most half a 16-bit
// ulp, and doing that rounding per weight halves the decode speed).
//
// Both share their output rows with one helper thread (pool.h). The matvec runs in explicit SIMD
// where the build's target has it (simd.h: AVX2 on x86-64, NEON on arm64), otherwise in GCC/Clang
// vector extensions (portable.h, qmv_portable, which any target builds); both compute the same
// bits, and the tests hold them to it. The products' arithmetic here (product_rows, sibling_rows)
// is shared with decode_block.h's DecodeTail.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <vector>

#include "arrays.h"
#include "elementwise.h"  // swiglu_range
#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/dtype.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"
#include "mlx/transforms.h"
#include "no_contract.h"
#include "norms.h"  // rms_norm_rows
#include "pool.h"
#include "portable.h"
#include "q8.h"
#include "simd.h"

namespace lmspd {

// Chunks of about this many weights x rows: a few microseconds each, and enough of them to share.
constexpr int CHUNK_WORK = 1 << 15;
inline int grain_for(int K, int M, int multiple) {
  int g = CHUNK_WORK / (K * (M < 8 ? M : 8));
  g = (g + multiple - 1) / multiple * multiple;
  return g < multiple ? multiple : g;
}

template <int BITS, int GS, typename S>
LMSPD_NO_CONTRACT_ATTR void dequantize_range(const uint32_t* w, const S* scales, const S* biases, float* out, int K,
                                             int n0, int n1) {
  LMSPD_NO_CONTRACT
  constexpr int G_WORDS = GS * BITS / 32;
  constexpr int VECS = GS / 8;
  const int G = K / GS;
  const int W = K * BITS / 32;
  const Unpack<BITS> unpack;
  for (int n = n0; n < n1; ++n) {
    for (int g = 0; g < G; ++g) {
      const uint32_t* wg = w + (size_t)n * W + g * G_WORDS;
      const float sg = static_cast<float>(scales[(size_t)n * G + g]);
      const float bg = static_cast<float>(biases[(size_t)n * G + g]);
      float* og = out + (size_t)n * K + g * GS;
      for (int i = 0; i < VECS; ++i) {
        // Multiply, then add (fp-contract is off): with float32 scales, mx.dequantize's bits.
        const v8f v = sg * unpack(wg, i) + bg;
        std::memcpy(og + i * 8, &v, sizeof(v8f));
      }
    }
  }
}

// The kernels with the scales' type erased, chosen at run time by bits, group size and dtype.
using Dequantizer = void (*)(const uint32_t*, const void*, const void*, float*, int, int, int);
using ExactKernel = void (*)(const float*, const float*, const uint32_t*, const void*, const void*, float*, int, int,
                             int, int, int);
using Q8Kernel = void (*)(const int8_t*, const float*, const float*, const uint32_t*, const void*, const void*, float*,
                          int, int, int, int, int);
// A product's kernel: the exact one, and where the process runs numerics = "fast" and the
// weights have 4 bits, the 8-bit activations' one, which then computes the product.
struct Kernel {
  ExactKernel exact = nullptr;
  Q8Kernel q8 = nullptr;
};

// The process's numerics (docs/numerics.md), as the engine last set it: each product's primitive
// takes it when its graph is built (``built_fast``), not when it is evaluated, so a pass still
// in flight (evaluated asynchronously: upstream/stepping.py) keeps its model's numerics after
// the engine sets another model's for that one's step.
inline std::atomic<bool>& fast_numerics() {
  static std::atomic<bool> fast{false};
  return fast;
}

template <int BITS, int GS, typename S>
void dequantize_erased(const uint32_t* w, const void* s, const void* b, float* out, int K, int n0, int n1) {
  dequantize_range<BITS, GS, S>(w, static_cast<const S*>(s), static_cast<const S*>(b), out, K, n0, n1);
}

template <int BITS, int GS, typename S>
void qmv_erased(const float* x, const float* xsum, const uint32_t* w, const void* s, const void* b, float* out, int M,
                int N, int K, int n0, int n1) {
  qmv_portable<BITS, GS, S>(x, xsum, w, static_cast<const S*>(s), static_cast<const S*>(b), out, M, N, K, n0, n1);
}

#if defined(LMSPD_SIMD)
template <int BITS, int GS, typename S>
void qmv_simd_erased(const float* x, const float* xsum, const uint32_t* w, const void* s, const void* b, float* out,
                     int M, int N, int K, int n0, int n1) {
  lmspd::qmv_simd<BITS, GS, S>(x, xsum, w, static_cast<const S*>(s), static_cast<const S*>(b), out, M, N, K, n0, n1);
}
#endif
template <int GS, typename S>
void q8_erased(const int8_t* xq, const float* xd, const float* xsum, const uint32_t* w, const void* s, const void* b,
               float* out, int M, int N, int K, int n0, int n1) {
  q8_portable<GS, S>(xq, xd, xsum, w, static_cast<const S*>(s), static_cast<const S*>(b), out, M, N, K, n0, n1);
}
#if defined(LMSPD_Q8_SIMD)
template <int GS, typename S>
void q8_simd_erased(const int8_t* xq, const float* xd, const float* xsum, const uint32_t* w, const void* s,
                    const void* b, float* out, int M, int N, int K, int n0, int n1) {
  q8_simd<GS, S>(xq, xd, xsum, w, static_cast<const S*>(s), static_cast<const S*>(b), out, M, N, K, n0, n1);
}
#endif
// The fast path's instruction set in this build: avx2, or portable (the same bits, slower).
inline const char* q8_simd_name() {
#if defined(LMSPD_Q8_SIMD)
  return kQ8Simd;
#else
  return "portable";
#endif
}
inline const char* simd_name() {
#if defined(LMSPD_SIMD)
  return lmspd::kSimd;
#else
  return "portable";
#endif
}

#define LMSPD_CASES(S)                                                                  \
  LMSPD_CASE(4, 32, S) LMSPD_CASE(4, 64, S) LMSPD_CASE(4, 128, S) LMSPD_CASE(8, 32, S) \
  LMSPD_CASE(8, 64, S) LMSPD_CASE(8, 128, S) LMSPD_CASE(2, 32, S) LMSPD_CASE(2, 64, S) \
  LMSPD_CASE(2, 128, S)
#define LMSPD_DTYPES                                                      \
  if (dtype == mx::float32) { LMSPD_CASES(float) }                        \
  if (dtype == mx::float16) { LMSPD_CASES(mx::float16_t) }               \
  if (dtype == mx::bfloat16) { LMSPD_CASES(mx::bfloat16_t) }

inline Dequantizer dequantizer_for(int bits, int group_size, mx::Dtype dtype) {
#define LMSPD_CASE(B, G, S) \
  if (bits == B && group_size == G) return &dequantize_erased<B, G, S>;
  LMSPD_DTYPES
#undef LMSPD_CASE
  return nullptr;
}

inline Q8Kernel q8_kernel_for(int group_size, mx::Dtype dtype, bool simd) {
#if defined(LMSPD_Q8_SIMD)
  if (simd) {
#define LMSPD_CASE(B, G, S) \
  if (B == 4 && group_size == G) return &q8_simd_erased<G, S>;
    LMSPD_DTYPES
#undef LMSPD_CASE
  }
#endif
  (void)simd;
#define LMSPD_CASE(B, G, S) \
  if (B == 4 && group_size == G) return &q8_erased<G, S>;
  LMSPD_DTYPES
#undef LMSPD_CASE
  return nullptr;
}

// simd: the SIMD kernel where the build has one (else the portable one, the same bits).
inline ExactKernel exact_kernel_for(int bits, int group_size, mx::Dtype dtype, bool simd) {
#if defined(LMSPD_SIMD)
  if (simd) {
#define LMSPD_CASE(B, G, S) \
  if (bits == B && group_size == G) return &qmv_simd_erased<B, G, S>;
    LMSPD_DTYPES
#undef LMSPD_CASE
  }
#endif
  (void)simd;
#define LMSPD_CASE(B, G, S) \
  if (bits == B && group_size == G) return &qmv_erased<B, G, S>;
  LMSPD_DTYPES
#undef LMSPD_CASE
  return nullptr;
}
#undef LMSPD_DTYPES
#undef LMSPD_CASES

inline bool built_fast() { return fast_numerics().load(std::memory_order_relaxed); }

inline Kernel kernel_for(int bits, int group_size, mx::Dtype dtype, bool simd, bool fast) {
  const bool q8 = bits == 4 && fast;
  return Kernel{exact_kernel_for(bits, group_size, dtype, simd), q8 ? q8_kernel_for(group_size, dtype, simd) : nullptr};
}

// x made ready for a product's kernel once, for both threads: its 8-bit rows where the kernel
// takes them, and its group sums (theirs, for the 8-bit kernel: q8.h, q8_group_sums).
struct Operands {
  const float* x;
  Q8Rows q8;
  lmspd::Floats xsum;
  Operands(const float* xp, int M, int K, int GS, const Kernel& kernel)
      : x(xp),
        q8(kernel.q8 ? quantize_rows(xp, M, K) : Q8Rows{}),
        xsum(kernel.q8 ? q8_group_sums(q8, M, K, GS) : group_sums(xp, M, K, GS)) {}
  void run(const Kernel& k, const uint32_t* w, const void* s, const void* b, float* out, int M, int N, int K, int n0,
           int n1) const {
    if (k.q8)
      k.q8(q8.q.data(), q8.d.data(), xsum.data(), w, s, b, out, M, N, K, n0, n1);
    else
      k.exact(x, xsum.data(), w, s, b, out, M, N, K, n0, n1);
  }
};

// The products' arithmetic, shared by the primitives below and decode_block.h's DecodeTail.
// xp: M rows of K (on a cache line: aligned_rows_of), times the N columns of w into op, the
// columns in chunks across both cores when split.
inline void product_rows(const float* xp, int M, int K, int GS, const uint32_t* wp, const void* sp, const void* bp,
                         float* op, int N, Kernel kernel, bool split) {
  const Operands x(xp, M, K, GS, kernel);  // once, for both threads
  if (!split)
    x.run(kernel, wp, sp, bp, op, M, N, K, 0, N);
  else
    pool().parallel_for(N, grain_for(K, M, 4), [&](int n0, int n1) { x.run(kernel, wp, sp, bp, op, M, N, K, n0, n1); });
}

// Stacked siblings' products of one xp: outs[j] gets the next widths[j] rows of w, the columns
// of all of them shared out across both cores as one product's.
inline void sibling_rows(const float* xp, int M, int K, int GS, int bits, const uint32_t* wp, const uint8_t* sp,
                         const uint8_t* bp, size_t item, const std::vector<int>& widths, float* const* outs, Kernel kernel,
                         bool split) {
  const int W = K * bits / 32, G = K / GS;
  const Operands x(xp, M, K, GS, kernel);
  int total = 0;
  for (int w : widths) total += w;
  pool().parallel_for(total, split ? grain_for(K, M, 4) : total, [&](int c0, int c1) {
    int start = 0;
    for (size_t j = 0; j < widths.size(); start += widths[j], ++j) {
      const int lo = c0 > start ? c0 : start, hi = c1 < start + widths[j] ? c1 : start + widths[j];
      if (lo >= hi) continue;
      x.run(kernel, wp + size_t(start) * W, sp + size_t(start) * G * item, bp + size_t(start) * G * item, outs[j], M,
            widths[j], K, lo - start, hi - start);
    }
  });
}

// op = residual + op, element by element: MLX's Add.
inline void add_residual(const float* rp, float* op, size_t n) {
  for (size_t i = 0; i < n; ++i) op[i] = rp[i] + op[i];
}

// x @ dequantize(w).T; with swiglu, of swiglu(x, up) (elementwise.h's arithmetic) instead of x;
// with a residual, residual + the product (MLX's Add): a decode step's MLP down product and its
// block's residual adds in the one primitive (upstream/decode_block.py), the same bits as the
// three primitives they replace, two fewer for MLX to dispatch.
class QuantizedMatvec : public mx::UnaryPrimitive {
 public:
  QuantizedMatvec(mx::Stream s, int bits, int group_size, bool split, bool simd, bool swiglu = false,
                  bool residual = false)
      : mx::UnaryPrimitive(s),
        bits_(bits),
        group_size_(group_size),
        split_(split),
        simd_(simd),
        swiglu_(swiglu),
        residual_(residual) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const auto& x = inputs[0];
    const auto& w = inputs[1];
    const auto& sc = inputs[2];
    const auto& bi = inputs[3];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = encoder_for(stream(), inputs, out);
    const int K = x.shape(-1);
    const int M = static_cast<int>(x.size() / K);
    const int N = out.shape(-1);
    Kernel kernel = kernel_for(bits_, group_size_, sc.dtype(), simd_, fast_);
    const bool split = split_;
    const int GS = group_size_;
    // After x, w, scales, biases: up (swiglu), then the residual.
    const View up(swiglu_ ? inputs[4] : x), res(residual_ ? inputs.back() : x);
    enc.dispatch([x = View(x), w = View(w), sc = View(sc), bi = View(bi), up, res, out = View(out), M, N, K, GS,
                  kernel, split, swiglu = swiglu_, residual = residual_]() mutable {
      lmspd::Floats copy, act;
      std::vector<float> up_copy;
      const float* xp = swiglu ? rows_of(x, copy) : aligned_rows_of(x, copy);
      if (swiglu) {
        act.resize(size_t(M) * K);
        swiglu_range(xp, rows_of(up, up_copy), act.data(), 0, act.size());
        xp = act.data();
      }
      float* op = out.data<float>();
      product_rows(xp, M, K, GS, w.data<uint32_t>(), sc.data<uint8_t>(), bi.data<uint8_t>(), op, N, kernel, split);
      if (residual) {
        std::vector<float> res_copy;
        add_residual(rows_of(res, res_copy), op, size_t(M) * N);
      }
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("lmspd quantized_matvec runs on the CPU only");
  }
  const char* name() const override { return "LmspdQuantizedMatvec"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const QuantizedMatvec&>(other);
    return bits_ == o.bits_ && group_size_ == o.group_size_ && split_ == o.split_ && simd_ == o.simd_ &&
           swiglu_ == o.swiglu_ && residual_ == o.residual_ && fast_ == o.fast_;
  }

 private:
  int bits_, group_size_;
  bool split_, simd_, swiglu_, residual_;
  bool fast_ = built_fast();  // the numerics when its graph was built
};

// Sibling layers' products of one x (q, k and v; gate and up) as one primitive, their weights
// stacked: one dispatch, one pass of group sums, and enough columns for both cores (a 192-wide
// k or v product alone is mostly fixed cost). Each output column is computed as the single
// product computes it: the same bits.
class QuantizedMatvecs : public mx::Primitive {
 public:
  QuantizedMatvecs(mx::Stream s, int bits, int group_size, std::vector<int> widths, bool split, bool norm = false,
                   float eps = 0.0f)
      : mx::Primitive(s),
        bits_(bits),
        group_size_(group_size),
        widths_(std::move(widths)),
        split_(split),
        norm_(norm),
        eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& x = inputs[0];
    const auto& sc = inputs[2];
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) enc.set_input_array(a);
    std::vector<float*> outs;
    for (auto& o : outputs) {
      o.set_data(mx::allocator::malloc(o.nbytes()));
      enc.set_output_array(o);
    }
    const int K = x.shape(-1);
    const int M = static_cast<int>(x.size() / K);
    const int GS = group_size_, bits = bits_;
    const size_t item = sc.itemsize();
    Kernel kernel = kernel_for(bits_, group_size_, sc.dtype(), true, fast_);
    std::vector<int> widths = widths_;
    std::vector<View> weak;
    weak.reserve(inputs.size() + outputs.size());
    for (const auto& a : inputs) weak.emplace_back(a);
    for (const auto& o : outputs) weak.emplace_back(o);
    const size_t first_out = inputs.size();
    enc.dispatch([weak = std::move(weak), widths, M, K, GS, bits, item, kernel, split = split_, norm = norm_,
                  eps = eps_, first_out]() mutable {
      lmspd::Floats copy, normed;
      const float* xp = norm ? rows_of(weak[0], copy) : aligned_rows_of(weak[0], copy);
      if (norm) {  // norms.h's RmsNorm, the weight after x, w, scales and biases
        normed.resize(size_t(M) * K);
        rms_norm_rows(xp, weak[4].data<float>(), normed.data(), M, K, eps);
        xp = normed.data();
      }
      std::vector<float*> outs;
      for (size_t j = 0; j < widths.size(); ++j) outs.push_back(weak[first_out + j].data<float>());
      sibling_rows(xp, M, K, GS, bits, weak[1].data<uint32_t>(), weak[2].data<uint8_t>(), weak[3].data<uint8_t>(), item,
                   widths, outs.data(), kernel, split);
    });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("lmspd quantized_matvecs runs on the CPU only");
  }
  const char* name() const override { return "LmspdQuantizedMatvecs"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const QuantizedMatvecs&>(other);
    return bits_ == o.bits_ && group_size_ == o.group_size_ && widths_ == o.widths_ && split_ == o.split_ &&
           norm_ == o.norm_ && eps_ == o.eps_ && fast_ == o.fast_;
  }

 private:
  int bits_, group_size_;
  std::vector<int> widths_;
  bool split_, norm_;
  float eps_;
  bool fast_ = built_fast();  // the numerics when its graph was built
};

class Dequantize : public mx::UnaryPrimitive {
 public:
  Dequantize(mx::Stream s, int bits, int group_size) : mx::UnaryPrimitive(s), bits_(bits), group_size_(group_size) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const auto& w = inputs[0];
    const auto& sc = inputs[1];
    const auto& bi = inputs[2];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = encoder_for(stream(), inputs, out);
    const int N = out.shape(0);
    const int K = out.shape(1);
    Dequantizer dq = dequantizer_for(bits_, group_size_, sc.dtype());
    enc.dispatch([w = View(w), sc = View(sc), bi = View(bi), out = View(out), N, K, dq]() mutable {
      const uint32_t* wp = w.data<uint32_t>();
      const void* sp = sc.data<uint8_t>();
      const void* bp = bi.data<uint8_t>();
      float* op = out.data<float>();
      pool().parallel_for(N, grain_for(K, 1, 1), [=](int n0, int n1) { dq(wp, sp, bp, op, K, n0, n1); });
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("lmspd dequantize runs on the CPU only");
  }
  const char* name() const override { return "LmspdDequantize"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Dequantize&>(other);
    return bits_ == o.bits_ && group_size_ == o.group_size_;
  }

 private:
  int bits_, group_size_;
};

inline void check(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size, int bits) {
  if (exact_kernel_for(bits, group_size, mx::float32, true) == nullptr)
    throw std::invalid_argument("unsupported bits/group_size");
  if (exact_kernel_for(bits, group_size, scales.dtype(), true) == nullptr || biases.dtype() != scales.dtype())
    throw std::invalid_argument("scales and biases must be float32, float16 or bfloat16, the same");
  if (w.dtype() != mx::uint32 || w.ndim() != 2) throw std::invalid_argument("w must be a 2-D uint32 array");
  if (scales.ndim() != 2 || scales.shape(0) != w.shape(0) || scales.shape(1) * group_size != w.shape(1) * 32 / bits ||
      biases.shape() != scales.shape())
    throw std::invalid_argument("w, scales and biases do not match");
}


inline mx::array dequantize(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size,
                            int bits) {
  check(w, scales, biases, group_size, bits);
  auto s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs = {row_contiguous(w, s), row_contiguous(scales, s), row_contiguous(biases, s)};
  return mx::array({w.shape(0), w.shape(1) * 32 / bits}, mx::float32,
                   std::make_shared<Dequantize>(s, bits, group_size), inputs);
}

// x @ dequantize(w, scales, biases).T for float32 x (MLX's packing, transposed weights), the
// products summed in float32.
// With up: of swiglu(x, up) (x the gate); with residual: residual + the product.
inline mx::array quantized_matvec(const mx::array& x, const mx::array& w, const mx::array& scales,
                                  const mx::array& biases, int group_size, int bits, bool split, bool simd,
                                  const std::optional<mx::array>& up, const std::optional<mx::array>& residual) {
  check(w, scales, biases, group_size, bits);
  if (x.dtype() != mx::float32 || x.ndim() < 1 || x.shape(-1) != w.shape(1) * 32 / bits)
    throw std::invalid_argument("x must be float32 with the weights' input size last");
  if (up && (up->dtype() != mx::float32 || up->shape() != x.shape()))
    throw std::invalid_argument("up must be float32, shaped as x");
  const int N = w.shape(0);
  auto s = mx::default_stream(mx::Device::cpu);
  auto shape = x.shape();
  shape.back() = N;
  if (residual && (residual->dtype() != mx::float32 || residual->shape() != shape))
    throw std::invalid_argument("the residual must be float32, shaped as the product");
  std::vector<mx::array> inputs = {x, row_contiguous(w, s), row_contiguous(scales, s),
                                   row_contiguous(biases, s)};
  if (up) inputs.push_back(*up);
  if (residual) inputs.push_back(*residual);
  return mx::array(shape, mx::float32,
                   std::make_shared<QuantizedMatvec>(s, bits, group_size, split, simd, bool(up), bool(residual)),
                   inputs);
}

// x @ dequantize(w).T for stacked weights, as one output per width (the rows of w, in order).
// With norm: of mx.fast.rms_norm(x, norm, eps) (norms.h's arithmetic) instead of x.
inline std::vector<mx::array> quantized_matvecs(const mx::array& x, const mx::array& w, const mx::array& scales,
                                                const mx::array& biases, int group_size, int bits, std::vector<int> widths,
                                                bool split, const std::optional<mx::array>& norm, float eps) {
  check(w, scales, biases, group_size, bits);
  if (x.dtype() != mx::float32 || x.ndim() < 1 || x.shape(-1) != w.shape(1) * 32 / bits)
    throw std::invalid_argument("x must be float32 with the weights' input size last");
  int total = 0;
  for (int n : widths) total += n > 0 ? n : -(1 << 30);
  if (widths.empty() || total != w.shape(0)) throw std::invalid_argument("the widths must add up to w's rows");
  auto s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::Shape> shapes;
  for (int n : widths) {
    auto shape = x.shape();
    shape.back() = n;
    shapes.push_back(shape);
  }
  if (norm && (norm->dtype() != mx::float32 || norm->ndim() != 1 || norm->shape(0) != x.shape(-1)))
    throw std::invalid_argument("the norm's weight must be float32, 1-D and as wide as x");
  std::vector<mx::array> inputs = {x, row_contiguous(w, s), row_contiguous(scales, s),
                                   row_contiguous(biases, s)};
  if (norm) inputs.push_back(row_contiguous(*norm, s));
  return mx::array::make_arrays(std::move(shapes), std::vector<mx::Dtype>(widths.size(), mx::float32),
                                std::make_shared<QuantizedMatvecs>(s, bits, group_size, widths, split, bool(norm), eps),
                                inputs);
}

// Seconds to read all of a's bytes once on both threads: the memory bandwidth a matvec's
// weights stream at, for bench.matvec's bound.
inline double read_seconds(const mx::array& a) {
  mx::eval({a});
  const auto* p = a.data<uint64_t>();
  const size_t n = a.nbytes() / sizeof(uint64_t);
  std::atomic<uint64_t> sink{0};
  auto part = [&](size_t i0, size_t i1) {
    typedef uint64_t v4u __attribute__((vector_size(32)));
    v4u acc = {0, 0, 0, 0};
    for (size_t i = i0; i + 4 <= i1; i += 4) {
      v4u v;
      std::memcpy(&v, p + i, sizeof(v));
      acc += v;
    }
    sink += acc[0] + acc[1] + acc[2] + acc[3];
  };
  const auto start = std::chrono::steady_clock::now();
  pool().parallel_for(int(n >> 16), 1, [&](int c0, int c1) { part(size_t(c0) << 16, size_t(c1) << 16); });
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace lmspd
