// Single primitives for what MLX's fast ops build as graphs on the CPU, bit for bit.
//
// MLX's CPU backend has no kernels for its fast ops: each builds its fallback graph of plain
// primitives, and a decode step's many small calls are dispatch-bound (bench/step_profile.py).
//
// TableRope. MLX's CPU backend has no RoPE kernel: mx.fast.rope there builds its fallback graph, ~15
// primitives a call (positions, frequencies, cos, sin, slices, products, concatenation), and a
// decode step of SmolLM2-135M calls it 60 times (step_profile's "rope" row: 4-5 ms of a step).
// TableRope takes the fallback's own cos and sin for every position, computed once by MLX's
// ops (packed.py: the same ops on all positions at once, elementwise, so the same values), and
// does the rotation with the fallback's arithmetic, each product rounded to float32 before the
// sum: bit for bit mx.fast.rope (tested), in one primitive.
#pragma once

// Included by quantized.cpp, after MLX's headers and the mx alias.

#if defined(__clang__)
#define LMSPD_NO_CONTRACT _Pragma("clang fp contract(off)")
#define LMSPD_NO_CONTRACT_ATTR
#else
#define LMSPD_NO_CONTRACT
#define LMSPD_NO_CONTRACT_ATTR __attribute__((optimize("fp-contract=off")))
#endif

namespace {

// What a task reads of an array: the address of its elements and its layout, taken when the
// primitive is evaluated (its inputs' buffers are set by then, its output's just before). MLX's
// own tasks capture array::unsafe_weak_copy: four allocations an array (a descriptor, its shape,
// its strides, the buffer's holder), made on the engine's main thread and freed on the stream's,
// ~1,200 arrays a decode step and a tenth of the main thread's CPU (docs/benchmarks.md, "Ninth
// pass"). As with the weak copies, the encoder holds the buffers until the task has run.
class View {
 public:
  static constexpr int kMaxDims = 8;
  explicit View(const mx::array& a)
      : data_(const_cast<void*>(a.data<void>())),
        size_(a.size()),
        itemsize_(a.itemsize()),
        dtype_(a.dtype()),
        flags_(a.flags()),
        ndim_(a.ndim()) {
    if (ndim_ > kMaxDims) throw std::invalid_argument("lmspd's kernels take arrays of at most 8 dimensions");
    for (int d = 0; d < ndim_; ++d) {
      shape_[d] = a.shape(d);
      strides_[d] = a.strides()[d];
    }
  }
  template <typename T>
  T* data() const {
    return static_cast<T*>(data_);
  }
  int ndim() const { return ndim_; }
  int shape(int d) const { return shape_[d < 0 ? d + ndim_ : d]; }
  const std::array<int32_t, kMaxDims>& shape() const { return shape_; }
  const std::array<int64_t, kMaxDims>& strides() const { return strides_; }
  size_t size() const { return size_; }
  size_t itemsize() const { return itemsize_; }
  size_t nbytes() const { return size_ * itemsize_; }
  mx::Dtype dtype() const { return dtype_; }
  const mx::array::Flags& flags() const { return flags_; }

 private:
  void* data_;
  size_t size_, itemsize_;
  mx::Dtype dtype_;
  mx::array::Flags flags_;
  int ndim_;
  std::array<int32_t, kMaxDims> shape_{};
  std::array<int64_t, kMaxDims> strides_{};
};

// An activation's elements in row-major order, for the kernels, which read rows. Activations
// reach the primitives as they come: a Contiguous node per activation per call was 242 of a
// decode step's 1,340 primitives (docs/benchmarks.md, "Step profile"), and at evaluation they
// are nearly always row-contiguous already (MLX flags a transposed axis of size 1 so); only
// otherwise are they copied, here.
template <typename A, typename Vec>
inline const float* rows_of(const A& x, Vec& copy) {
  if (x.flags().row_contiguous || x.size() == 0) return x.template data<float>();
  copy.resize(x.size());
  const auto& shape = x.shape();
  const auto& strides = x.strides();
  const int nd = x.ndim();
  const float* base = x.template data<float>();
  const size_t inner = shape[nd - 1];
  const int64_t step = strides[nd - 1];
  std::vector<int> at(nd, 0);
  for (size_t done = 0; done < x.size(); done += inner) {
    int64_t offset = 0;
    for (int d = 0; d < nd - 1; ++d) offset += int64_t(at[d]) * strides[d];
    for (size_t i = 0; i < inner; ++i) copy[done + i] = base[offset + int64_t(i) * step];
    for (int d = nd - 2; d >= 0; --d) {
      if (++at[d] < shape[d]) break;
      at[d] = 0;
    }
  }
  return copy.data();
}

// rows_of, on a cache-line boundary (portable.h, Aligned64): copied when MLX's buffer is not.
template <typename A>
inline const float* aligned_rows_of(const A& x, lmspd::Floats& copy) {
  if (!x.flags().row_contiguous || x.size() == 0) return rows_of(x, copy);
  const float* p = x.template data<float>();
  if (reinterpret_cast<uintptr_t>(p) % 64 == 0) return p;
  copy.assign(p, p + x.size());
  return copy.data();
}

// A single-output primitive's arrays for its task: the output given a fresh buffer, every array
// registered with the stream's encoder (which holds their buffers until the task has run), and
// views of the inputs then the output.
inline std::vector<View> task_arrays(const std::vector<mx::array>& inputs, mx::array& out,
                                     mx::cpu::CommandEncoder& enc) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  std::vector<View> views;
  views.reserve(inputs.size() + 1);
  for (const auto& a : inputs) {
    enc.set_input_array(a);
    views.emplace_back(a);
  }
  enc.set_output_array(out);
  views.emplace_back(out);
  return views;
}

// x: (B, H, T, D) row-contiguous; cs, sn: (P, dims / 2); offset: B positions, or one for all.
LMSPD_NO_CONTRACT_ATTR void rope_rows(const float* x, const float* cs, const float* sn, const int32_t* offset,
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
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
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

// RMSNorm as mx.fast.rms_norm's CPU fallback computes it, for float32 x and weight: per row,
// the squares x * x summed one after another from 0 (MLX's CPU sum reduction of a contiguous
// row), times 1 / D as float32, plus eps, then 1 / sqrt of that; each x times it, then times
// the weight, every product rounded. Two primitives of the fallback's eight per call, 61 calls a
// SmolLM2 decode step.
LMSPD_NO_CONTRACT_ATTR void rms_norm_rows(const float* x, const float* w, float* out, size_t rows, int D, float eps) {
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
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
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

}  // namespace
