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
// Both split the output rows with one helper thread. Vectors are GCC/Clang vector extensions,
// so the same source builds for x86-64 and arm64 (the engine builds it on the machine that
// runs it, see kernels/__init__.py).
#include <nanobind/nanobind.h>

#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

typedef float v8f __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));

// MLX's packing: element j of a row is bits [BITS * j, BITS * (j + 1)) of the row's words.
template <int BITS>
struct Unpack {
  v8u shift, word, mask;
  Unpack() {
    for (int l = 0; l < 8; ++l) {
      shift[l] = (l * BITS) % 32;
      word[l] = (l * BITS) / 32;
      mask[l] = (1u << BITS) - 1u;
    }
  }
  // Elements [8i, 8i + 8) of the group whose words start at wg, as floats.
  v8f operator()(const uint32_t* wg, int i) const {
    const uint32_t* wi = wg + i * 8 * BITS / 32;
    v8u words;
    for (int l = 0; l < 8; ++l) words[l] = wi[word[l]];
    const uint32_t offset = (i * 8 * BITS) % 32;  // 2-bit: odd vectors start mid-word
    return __builtin_convertvector((words >> (shift + offset)) & mask, v8f);
  }
};

// One helper thread that takes the second half of the output columns; the MLX stream thread
// does the first. Kept for the process's life: a thread started per call would cost more than
// a decode-size product.
class Helper {
 public:
  Helper() : thread_([this] { loop(); }) { thread_.detach(); }
  void run(std::function<void()> mine, std::function<void()> theirs) {
    std::lock_guard<std::mutex> one_at_a_time(run_mu_);  // one helper: callers take turns
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_ = std::move(theirs);
      done_ = false;
    }
    cv_.notify_one();
    mine();
    std::unique_lock<std::mutex> lock(mu_);
    cv_done_.wait(lock, [this] { return done_; });
  }

 private:
  void loop() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return static_cast<bool>(job_); });
        job = std::move(job_);
        job_ = nullptr;
      }
      job();
      {
        std::lock_guard<std::mutex> lock(mu_);
        done_ = true;
      }
      cv_done_.notify_one();
    }
  }
  std::mutex run_mu_, mu_;
  std::condition_variable cv_, cv_done_;
  std::function<void()> job_;
  bool done_ = true;
  std::thread thread_;
};

Helper& helper() {
  static Helper* h = new Helper();  // never destroyed: its thread outlives static teardown
  return *h;
}

template <int BITS, int GS, typename S>
void qmv_range(const float* x, const uint32_t* w, const S* scales, const S* biases, float* out, int M, int N,
               int K, int n0, int n1) {
  constexpr int G_WORDS = GS * BITS / 32;  // packed words per group
  constexpr int VECS = GS / 8;            // float vectors per group
  const int G = K / GS;
  const int W = K * BITS / 32;
  const Unpack<BITS> unpack;
  // Each group's sum of x, per row: the biases' share is bias * sum(x), once per group.
  std::vector<float> xsum((size_t)M * G);
  for (int m = 0; m < M; ++m)
    for (int g = 0; g < G; ++g) {
      float sum = 0;
      for (int j = 0; j < GS; ++j) sum += x[(size_t)m * K + g * GS + j];
      xsum[(size_t)m * G + g] = sum;
    }
  for (int n = n0; n < n1; ++n) {
    const uint32_t* wn = w + (size_t)n * W;
    const S* sn = scales + (size_t)n * G;
    const S* bn = biases + (size_t)n * G;
    for (int m0 = 0; m0 < M; m0 += 8) {
      const int mc = M - m0 < 8 ? M - m0 : 8;
      v8f res[8];
      float bsum[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int mm = 0; mm < 8; ++mm) res[mm] = (v8f){0, 0, 0, 0, 0, 0, 0, 0};
      for (int g = 0; g < G; ++g) {
        const uint32_t* wg = wn + g * G_WORDS;
        v8f q[VECS];  // this group's quantized values, unpacked once for all rows
        for (int i = 0; i < VECS; ++i) q[i] = unpack(wg, i);
        const float sg = static_cast<float>(sn[g]), bg = static_cast<float>(bn[g]);
        for (int mm = 0; mm < mc; ++mm) {
          const float* xg = x + (size_t)(m0 + mm) * K + g * GS;
          v8f acc = {0, 0, 0, 0, 0, 0, 0, 0};
          for (int i = 0; i < VECS; ++i) {
            v8f xv;
            std::memcpy(&xv, xg + i * 8, sizeof(v8f));
            acc += xv * q[i];
          }
          res[mm] += sg * acc;
          bsum[mm] += bg * xsum[(size_t)(m0 + mm) * G + g];
        }
      }
      for (int mm = 0; mm < mc; ++mm) {
        const v8f r = res[mm];
        out[(size_t)(m0 + mm) * N + n] = (((r[0] + r[4]) + (r[1] + r[5])) + ((r[2] + r[6]) + (r[3] + r[7]))) + bsum[mm];
      }
    }
  }
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
using Kernel = void (*)(const float*, const uint32_t*, const void*, const void*, float*, int, int, int, int, int);

template <int BITS, int GS, typename S>
void dequantize_erased(const uint32_t* w, const void* s, const void* b, float* out, int K, int n0, int n1) {
  dequantize_range<BITS, GS, S>(w, static_cast<const S*>(s), static_cast<const S*>(b), out, K, n0, n1);
}

template <int BITS, int GS, typename S>
void qmv_erased(const float* x, const uint32_t* w, const void* s, const void* b, float* out, int M, int N, int K,
                int n0, int n1) {
  qmv_range<BITS, GS, S>(x, w, static_cast<const S*>(s), static_cast<const S*>(b), out, M, N, K, n0, n1);
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

Kernel kernel_for(int bits, int group_size, mx::Dtype dtype) {
#define LMSPD_CASE(B, G, S) \
  if (bits == B && group_size == G) return &qmv_erased<B, G, S>;
  LMSPD_DTYPES
#undef LMSPD_CASE
  return nullptr;
}

class QuantizedMatvec : public mx::UnaryPrimitive {
 public:
  QuantizedMatvec(mx::Stream s, int bits, int group_size, bool split)
      : mx::UnaryPrimitive(s), bits_(bits), group_size_(group_size), split_(split) {}

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
    Kernel kernel = kernel_for(bits_, group_size_, sc.dtype());
    const bool split = split_ && N >= 64;
    enc.dispatch([x = mx::array::unsafe_weak_copy(x), w = mx::array::unsafe_weak_copy(w),
                  sc = mx::array::unsafe_weak_copy(sc), bi = mx::array::unsafe_weak_copy(bi),
                  out = mx::array::unsafe_weak_copy(out), M, N, K, kernel, split]() mutable {
      const float* xp = x.data<float>();
      const uint32_t* wp = w.data<uint32_t>();
      const void* sp = sc.data<uint8_t>();
      const void* bp = bi.data<uint8_t>();
      float* op = out.data<float>();
      if (!split) return kernel(xp, wp, sp, bp, op, M, N, K, 0, N);
      const int half = N / 2;
      helper().run([=] { kernel(xp, wp, sp, bp, op, M, N, K, 0, half); },
                   [=] { kernel(xp, wp, sp, bp, op, M, N, K, half, N); });
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("lmspd quantized_matvec runs on the CPU only");
  }
  const char* name() const override { return "LmspdQuantizedMatvec"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const QuantizedMatvec&>(other);
    return bits_ == o.bits_ && group_size_ == o.group_size_ && split_ == o.split_;
  }

 private:
  int bits_, group_size_;
  bool split_;
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
    enc.dispatch([w = mx::array::unsafe_weak_copy(w), sc = mx::array::unsafe_weak_copy(sc),
                  bi = mx::array::unsafe_weak_copy(bi), out = mx::array::unsafe_weak_copy(out), N, K, dq]() mutable {
      const uint32_t* wp = w.data<uint32_t>();
      const void* sp = sc.data<uint8_t>();
      const void* bp = bi.data<uint8_t>();
      float* op = out.data<float>();
      const int half = N / 2;
      helper().run([=] { dq(wp, sp, bp, op, K, 0, half); }, [=] { dq(wp, sp, bp, op, K, half, N); });
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

mx::array dequantize(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size, int bits) {
  check(w, scales, biases, group_size, bits);
  auto s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs = {mx::contiguous(w, false, s), mx::contiguous(scales, false, s),
                                   mx::contiguous(biases, false, s)};
  return mx::array({w.shape(0), w.shape(1) * 32 / bits}, mx::float32,
                   std::make_shared<Dequantize>(s, bits, group_size), inputs);
}

// x @ dequantize(w, scales, biases).T for float32 x (MLX's packing, transposed weights), the
// products summed in float32.
mx::array quantized_matvec(const mx::array& x, const mx::array& w, const mx::array& scales,
                           const mx::array& biases, int group_size, int bits, bool split) {
  check(w, scales, biases, group_size, bits);
  if (x.dtype() != mx::float32 || x.ndim() < 1 || x.shape(-1) != w.shape(1) * 32 / bits)
    throw std::invalid_argument("x must be float32 with the weights' input size last");
  const int N = w.shape(0);
  auto s = mx::default_stream(mx::Device::cpu);
  auto shape = x.shape();
  shape.back() = N;
  std::vector<mx::array> inputs = {mx::contiguous(x, false, s), mx::contiguous(w, false, s),
                                   mx::contiguous(scales, false, s), mx::contiguous(biases, false, s)};
  return mx::array(shape, mx::float32, std::make_shared<QuantizedMatvec>(s, bits, group_size, split), inputs);
}

}  // namespace

NB_MODULE(quantized_ext, m) {
  m.def("quantized_matvec", &quantized_matvec, nb::arg("x"), nb::arg("w"), nb::arg("scales"), nb::arg("biases"),
        nb::arg("group_size"), nb::arg("bits"), nb::arg("split") = true);
  m.def("dequantize", &dequantize, nb::arg("w"), nb::arg("scales"), nb::arg("biases"), nb::arg("group_size"),
        nb::arg("bits"));
}
