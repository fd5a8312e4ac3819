// How the kernels read MLX's arrays: the views their tasks capture (View), an activation's
// rows in row-major order (rows_of, aligned_rows_of), a primitive's arrays registered with the
// stream's encoder (task_arrays), and a weight passed as it already is (row_contiguous).
#pragma once

#include <array>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/stream.h"
#include "portable.h"

namespace lmspd {

namespace mx = mlx::core;

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

// A primitive's command encoder with its inputs and its output declared to it, as MLX's own CPU
// primitives declare theirs before they dispatch.
inline mx::cpu::CommandEncoder& encoder_for(mx::Stream s, const std::vector<mx::array>& inputs, mx::array& out) {
  auto& enc = mx::cpu::get_command_encoder(s);
  for (const auto& a : inputs) enc.set_input_array(a);
  enc.set_output_array(out);
  return enc;
}

// An activation's elements in row-major order, for the kernels, which read rows. Activations
// reach the primitives as they come: a Contiguous node per activation per call was 242 of a
// decode step's 1,340 primitives (docs/benchmarks.md, "The passes", the second), and at evaluation they
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

// A weight, table or offset as the kernels read it: row-contiguous. One already evaluated that
// way is passed as it is: a Contiguous node per weight per product was ~630 of a decode step's
// graph. Activations (x) are passed as they come and read through rows_of, above.
inline mx::array row_contiguous(const mx::array& a, mx::Stream s) {
  if (a.is_available() && a.flags().row_contiguous) return a;
  return mx::contiguous(a, false, s);
}

}  // namespace lmspd
