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
// is exact, the sum rounded once. With float32 scales that is mx.dequantize's output bit for
// bit (no fused multiply-add); with 16-bit scales mx.dequantize rounds the product and the sum
// again to 16 bits, which these kernels do not (the values differ by at most half a 16-bit
// ulp, and doing that rounding per weight halves the decode speed).
//
// Both share their output rows with one helper thread (Pool). The matvec runs in explicit SIMD where the
// build's target has it (simd.h: AVX2 on x86-64, NEON on arm64), otherwise in GCC/Clang vector
// extensions (qmv_portable, which any target builds); both compute the same bits, and the tests
// hold them to it. The engine builds this on the machine that runs it (kernels/__init__.py).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <sched.h>
#include <stdexcept>
#include <thread>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace nb = nanobind;
namespace mx = mlx::core;

#include "portable.h"
#include "simd.h"
#include "fused.h"

namespace {

using lmspd::group_sums;
using lmspd::qmv_portable;
using lmspd::Unpack;
using lmspd::v8f;

// Both cores on every product: the MLX stream thread and one helper thread take runs of chunks
// of the output columns, from the two ends, until none are left. The caller never waits for a
// chunk nobody has started: on a busy machine, where the helper may not be scheduled for a
// while, the caller does the work alone instead of waiting a scheduler slice for it (a fixed
// half per thread cost a 192-column product 10x). The helper is kept for the process's life
// and spins briefly after each job before it sleeps: a decode step runs ~200 products tens of
// microseconds apart, and waking a sleeping thread costs about as much as one.
class Pool {
 public:
  Pool() : thread_([this] { loop(); }) { thread_.detach(); }

  // fn(c0, c1) for chunks [c0, c1) of [0, n), grain wide (the last one narrower).
  void parallel_for(int n, int grain, const std::function<void(int, int)>& fn) {
    const int chunks = (n + grain - 1) / grain;
    if (chunks <= 1 || chunks >= (1 << 16)) return fn(0, n);
    std::lock_guard<std::mutex> one_at_a_time(run_mu_);
    fn_ = &fn;
    n_ = n;
    grain_ = grain;
    const uint32_t t = ++ticket_ == 0 ? ++ticket_ : ticket_;  // 0 means "no job"
    state_.store((uint64_t(t) << 32) | uint64_t(chunks));
    posted_.store(t);
    posted_.notify_one();  // a futex wake only when the helper sleeps
    work(t, false);
    // Every chunk is taken; the helper may still be in its last one.
    for (int i = 0; i < SPINS && working_.load() == t; ++i) pause();
    for (uint32_t w; (w = working_.load()) == t;) working_.wait(w);
  }

 private:
  static void pause() {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }
  // The next run of chunks of job t, if t is still the job and a chunk is left. state_ holds
  // the job's ticket, the first chunk nobody has taken and one past the last, in one word, so a
  // late helper can never take a chunk of a job that has moved on. The caller takes from the
  // front, the helper from the back, each a quarter of what is left (a chunk at least): each
  // thread reads its weights in long runs in order (the prefetchers see one stream each), their
  // outputs meet in one place only, and the shared word moves between the cores a few times a
  // product rather than once a chunk (at eight rows a chunk is ~1 us).
  bool claim(uint32_t t, bool back, int& c0, int& c1) {
    uint64_t s = state_.load();
    for (;;) {
      const int front = int((s >> 16) & 0xffff), end = int(s & 0xffff);
      if (uint32_t(s >> 32) != t || front >= end) return false;
      const int take = std::clamp((end - front) / 4, 1, MAX_RUN);
      const uint64_t next = back ? s - uint64_t(take) : s + (uint64_t(take) << 16);
      if (state_.compare_exchange_weak(s, next)) {
        c0 = back ? end - take : front;
        c1 = c0 + take;
        return true;
      }
    }
  }
  void work(uint32_t t, bool back) {
    for (int c0, c1; claim(t, back, c0, c1);) {
      const int end = c1 * grain_;
      (*fn_)(c0 * grain_, end < n_ ? end : n_);
    }
  }
  void loop() {
    using clock = std::chrono::steady_clock;
    uint32_t seen = 0;
    for (;;) {
      const auto until = clock::now() + std::chrono::microseconds(SPIN_US);
      // Spinning, the helper yields its core rather than pausing on it: in a served decode the
      // engine's main thread (the next step's graph) and the server's threads want the same two
      // cores between products, and a spin that holds one makes them wait (one stream 1.04x,
      // docs/benchmarks.md, "Eighth pass"). With nothing else to run, sched_yield returns at once.
      while (posted_.load(std::memory_order_relaxed) == seen && clock::now() < until) sched_yield();
      posted_.wait(seen);  // returns at once when a job came meanwhile
      seen = posted_.load();
      working_.store(seen);  // before claiming: the caller waits while the helper is in its job
      work(seen, true);
      working_.store(0);
      working_.notify_one();
    }
  }
  static inline const int SPIN_US = [] {  // a tuning knob for bench.matvec, not a setting
    const char* v = std::getenv("LMSPD_KERNEL_SPIN_US");
    return v ? std::atoi(v) : 50;
  }();
  static constexpr int SPINS = 2000;
  static constexpr int MAX_RUN = 8;  // chunks: what the caller may wait for if the helper is preempted in them
  std::mutex run_mu_;
  const std::function<void(int, int)>* fn_ = nullptr;
  int n_ = 0, grain_ = 1;
  uint32_t ticket_ = 0;
  std::atomic<uint64_t> state_{0};
  std::atomic<uint32_t> posted_{0}, working_{0};
  std::thread thread_;
};

Pool& pool() {
  static Pool* p = new Pool();  // never destroyed: its thread outlives static teardown
  return *p;
}

}  // namespace

#include "elementwise.h"  // these two use the Pool
#include "attention.h"    // and exp8, from elementwise.h

namespace {

// Chunks of about this many weights x rows: a few microseconds each, and enough of them to share.
constexpr int CHUNK_WORK = 1 << 15;
int grain_for(int K, int M, int multiple) {
  int g = CHUNK_WORK / (K * (M < 8 ? M : 8));
  g = (g + multiple - 1) / multiple * multiple;
  return g < multiple ? multiple : g;
}

template <int BITS, int GS, typename S>
#if defined(__clang__)
void dequantize_range(const uint32_t* w, const S* scales, const S* biases, float* out, int K, int n0, int n1) {
#pragma clang fp contract(off)
#else
__attribute__((optimize("fp-contract=off"))) void dequantize_range(const uint32_t* w, const S* scales,
                                                                   const S* biases, float* out, int K, int n0,
                                                                   int n1) {
#endif
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
using Kernel = void (*)(const float*, const float*, const uint32_t*, const void*, const void*, float*, int, int, int,
                        int, int);

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
const char* simd_name() {
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

Dequantizer dequantizer_for(int bits, int group_size, mx::Dtype dtype) {
#define LMSPD_CASE(B, G, S) \
  if (bits == B && group_size == G) return &dequantize_erased<B, G, S>;
  LMSPD_DTYPES
#undef LMSPD_CASE
  return nullptr;
}

// simd: the SIMD kernel where the build has one (else the portable one, the same bits).
Kernel kernel_for(int bits, int group_size, mx::Dtype dtype, bool simd = true) {
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

// The products' arithmetic, shared by the primitives below and decode_block.h's DecodeTail.
// xp: M rows of K (on a cache line: aligned_rows_of), times the N columns of w into op, the
// columns in chunks across both cores when split.
void product_rows(const float* xp, int M, int K, int GS, const uint32_t* wp, const void* sp, const void* bp, float* op,
                  int N, Kernel kernel, bool split) {
  const lmspd::Floats xsum = group_sums(xp, M, K, GS);  // once, for both threads
  const float* xs = xsum.data();
  if (!split)
    kernel(xp, xs, wp, sp, bp, op, M, N, K, 0, N);
  else
    pool().parallel_for(N, grain_for(K, M, 4), [=](int n0, int n1) { kernel(xp, xs, wp, sp, bp, op, M, N, K, n0, n1); });
}

// Stacked siblings' products of one xp: outs[j] gets the next widths[j] rows of w, the columns
// of all of them shared out across both cores as one product's.
void sibling_rows(const float* xp, int M, int K, int GS, int bits, const uint32_t* wp, const uint8_t* sp,
                  const uint8_t* bp, size_t item, const std::vector<int>& widths, float* const* outs, Kernel kernel,
                  bool split) {
  const int W = K * bits / 32, G = K / GS;
  const lmspd::Floats xsum = group_sums(xp, M, K, GS);
  const float* xs = xsum.data();
  int total = 0;
  for (int w : widths) total += w;
  pool().parallel_for(total, split ? grain_for(K, M, 4) : total, [&](int c0, int c1) {
    int start = 0;
    for (size_t j = 0; j < widths.size(); start += widths[j], ++j) {
      const int lo = c0 > start ? c0 : start, hi = c1 < start + widths[j] ? c1 : start + widths[j];
      if (lo >= hi) continue;
      kernel(xp, xs, wp + size_t(start) * W, sp + size_t(start) * G * item, bp + size_t(start) * G * item, outs[j], M,
             widths[j], K, lo - start, hi - start);
    }
  });
}

// op = residual + op, element by element: MLX's Add.
void add_residual(const float* rp, float* op, size_t n) {
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
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
    const int K = x.shape(-1);
    const int M = static_cast<int>(x.size() / K);
    const int N = out.shape(-1);
    Kernel kernel = kernel_for(bits_, group_size_, sc.dtype(), simd_);
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
           swiglu_ == o.swiglu_ && residual_ == o.residual_;
  }

 private:
  int bits_, group_size_;
  bool split_, simd_, swiglu_, residual_;
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
    Kernel kernel = kernel_for(bits_, group_size_, sc.dtype(), true);
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
      if (norm) {  // fused.h's RMSNorm, the weight after x, w, scales and biases
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
           norm_ == o.norm_ && eps_ == o.eps_;
  }

 private:
  int bits_, group_size_;
  std::vector<int> widths_;
  bool split_, norm_;
  float eps_;
};

class Dequantize : public mx::UnaryPrimitive {
 public:
  Dequantize(mx::Stream s, int bits, int group_size) : mx::UnaryPrimitive(s), bits_(bits), group_size_(group_size) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const auto& w = inputs[0];
    const auto& sc = inputs[1];
    const auto& bi = inputs[2];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
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

void check(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size, int bits) {
  if (kernel_for(bits, group_size, mx::float32) == nullptr) throw std::invalid_argument("unsupported bits/group_size");
  if (kernel_for(bits, group_size, scales.dtype()) == nullptr || biases.dtype() != scales.dtype())
    throw std::invalid_argument("scales and biases must be float32, float16 or bfloat16, the same");
  if (w.dtype() != mx::uint32 || w.ndim() != 2) throw std::invalid_argument("w must be a 2-D uint32 array");
  if (scales.ndim() != 2 || scales.shape(0) != w.shape(0) || scales.shape(1) * group_size != w.shape(1) * 32 / bits ||
      biases.shape() != scales.shape())
    throw std::invalid_argument("w, scales and biases do not match");
}

// A weight, table or offset as the kernels read it: row-contiguous. One already evaluated that
// way is passed as it is: a Contiguous node per weight per product was ~630 of a decode step's
// graph. Activations (x) are passed as they come and read through rows_of (fused.h).
mx::array row_contiguous(const mx::array& a, mx::Stream s) {
  if (a.is_available() && a.flags().row_contiguous) return a;
  return mx::contiguous(a, false, s);
}

mx::array dequantize(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size, int bits) {
  check(w, scales, biases, group_size, bits);
  auto s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs = {row_contiguous(w, s), row_contiguous(scales, s), row_contiguous(biases, s)};
  return mx::array({w.shape(0), w.shape(1) * 32 / bits}, mx::float32,
                   std::make_shared<Dequantize>(s, bits, group_size), inputs);
}

// x @ dequantize(w, scales, biases).T for float32 x (MLX's packing, transposed weights), the
// products summed in float32.
// With up: of swiglu(x, up) (x the gate); with residual: residual + the product.
mx::array quantized_matvec(const mx::array& x, const mx::array& w, const mx::array& scales,
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

// x rotated by the tables' angles at positions offset + t (offset: one, or one per batch row).
mx::array rope(const mx::array& x, const mx::array& cos, const mx::array& sin, const mx::array& offset, int dims,
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

// x @ dequantize(w).T for stacked weights, as one output per width (the rows of w, in order).
// With norm: of mx.fast.rms_norm(x, norm, eps) (fused.h's arithmetic) instead of x.
std::vector<mx::array> quantized_matvecs(const mx::array& x, const mx::array& w, const mx::array& scales,
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

// mx.fast.rms_norm(x, weight, eps) for float32 x and weight.
mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps) {
  if (x.dtype() != mx::float32 || weight.dtype() != mx::float32 || x.ndim() < 1 || weight.ndim() != 1 ||
      weight.shape(0) != x.shape(-1))
    throw std::invalid_argument("x and weight must be float32, the weight 1-D and as wide as x");
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(x.shape(), mx::float32, std::make_shared<RmsNorm>(s, eps),
                   {x, row_contiguous(weight, s)});
}

// mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask): q (B, H, L, D), k (B,
// kvH, Lk, D), v (B, kvH, Lk, Dv), float32; mask None, bool or float32, broadcastable to (B, H,
// L, Lk), or (causal) the fallback's causal mask.
mx::array attention(const mx::array& q, const mx::array& k, const mx::array& v, const std::optional<mx::array>& mask,
                    float scale, bool causal) {
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
                   std::make_shared<Attention>(s, scale, kind), inputs);
}

}  // namespace

#include "decode_block.h"  // uses row_contiguous, above

namespace {

// mlx-lm's swiglu(gate, x) for float32 arrays of one shape.
mx::array swiglu(const mx::array& gate, const mx::array& x) {
  if (gate.dtype() != mx::float32 || x.dtype() != mx::float32 || gate.shape() != x.shape())
    throw std::invalid_argument("gate and x must be float32 arrays of one shape");
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(x.shape(), mx::float32, std::make_shared<SwiGLU>(s), {gate, x});
}

// mx.logsumexp(x, axis=-1, keepdims=True) for float32 x with at least one element a row.
mx::array logsumexp(const mx::array& x) {
  if (x.dtype() != mx::float32 || x.ndim() < 1 || x.shape(-1) == 0)
    throw std::invalid_argument("x must be float32 with a last axis of at least one element");
  auto s = mx::default_stream(mx::Device::cpu);
  auto shape = x.shape();
  shape.back() = 1;
  return mx::array(shape, mx::float32, std::make_shared<LogSumExp>(s), {x});
}

// Seconds to read all of a's bytes once on both threads: the memory bandwidth a matvec's
// weights stream at, for bench.matvec's bound.
double read_seconds(const mx::array& a) {
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

}  // namespace

NB_MODULE(quantized_ext, m) {
  m.def("quantized_matvec", &quantized_matvec, nb::arg("x"), nb::arg("w"), nb::arg("scales"), nb::arg("biases"),
        nb::arg("group_size"), nb::arg("bits"), nb::arg("split") = true, nb::arg("simd") = true,
        nb::arg("up").none() = nb::none(), nb::arg("residual").none() = nb::none());
  m.def("simd", &simd_name);  // the matvec's instruction set in this build: avx2, neon or portable
  m.def("read_seconds", &read_seconds, nb::arg("a"));
  m.def("quantized_matvecs", &quantized_matvecs, nb::arg("x"), nb::arg("w"), nb::arg("scales"), nb::arg("biases"),
        nb::arg("group_size"), nb::arg("bits"), nb::arg("widths"), nb::arg("split") = true,
        nb::arg("norm").none() = nb::none(), nb::arg("eps") = 0.0f);
  m.def("rms_norm", &rms_norm, nb::arg("x"), nb::arg("weight"), nb::arg("eps"));
  m.def("rope", &rope, nb::arg("x"), nb::arg("cos"), nb::arg("sin"), nb::arg("offset"), nb::arg("dims"),
        nb::arg("traditional"));
  m.def("attention", &attention, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("mask").none(), nb::arg("scale"),
        nb::arg("causal") = false);
  m.def("cache_write", &cache_write, nb::arg("new"), nb::arg("cache"), nb::arg("at"), nb::arg("cos").none() = nb::none(),
        nb::arg("sin").none() = nb::none(), nb::arg("offset").none() = nb::none(), nb::arg("dims") = 0,
        nb::arg("traditional") = false);
  m.def("decode_attend", &decode_attend, nb::arg("q"), nb::arg("keys"), nb::arg("values"), nb::arg("cos"),
        nb::arg("sin"), nb::arg("offset"), nb::arg("mask").none(), nb::arg("at"), nb::arg("scale"), nb::arg("dims"),
        nb::arg("traditional"), nb::arg("heads"));
  m.def("decode_tail", &decode_tail, nb::arg("q"), nb::arg("keys"), nb::arg("values"), nb::arg("cos"), nb::arg("sin"),
        nb::arg("offset"), nb::arg("mask").none(), nb::arg("at"), nb::arg("scale"), nb::arg("dims"),
        nb::arg("traditional"), nb::arg("heads"), nb::arg("x"), nb::arg("o_w"), nb::arg("o_scales"),
        nb::arg("o_biases"), nb::arg("o_group_size"), nb::arg("o_bits"), nb::arg("norm"), nb::arg("eps"),
        nb::arg("gate_up_w"), nb::arg("gate_up_scales"), nb::arg("gate_up_biases"), nb::arg("gate_up_group_size"),
        nb::arg("gate_up_bits"), nb::arg("widths"), nb::arg("down_w"), nb::arg("down_scales"),
        nb::arg("down_biases"), nb::arg("down_group_size"), nb::arg("down_bits"));
  m.def("swiglu", &swiglu, nb::arg("gate"), nb::arg("x"));
  m.def("logsumexp", &logsumexp, nb::arg("x"));
  m.def("dequantize", &dequantize, nb::arg("w"), nb::arg("scales"), nb::arg("biases"), nb::arg("group_size"),
        nb::arg("bits"));
}
