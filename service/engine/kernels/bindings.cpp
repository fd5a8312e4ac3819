// The kernels' Python module: the nanobind bindings and nothing else. Each family of primitives
// is a header of its own (docs/engine.md, "The kernels' sources"); this is the one translation
// unit that includes them all, so the engine's build (kernels/__init__.py) compiles one file.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "attention.h"
#include "decode_block.h"
#include "elementwise.h"
#include "norms.h"
#include "quantized.h"
#include "rope.h"

namespace nb = nanobind;
using namespace lmspd;

NB_MODULE(quantized_ext, m) {
  m.def("quantized_matvec", &quantized_matvec, nb::arg("x"), nb::arg("w"), nb::arg("scales"), nb::arg("biases"),
        nb::arg("group_size"), nb::arg("bits"), nb::arg("split") = true, nb::arg("simd") = true,
        nb::arg("up").none() = nb::none(), nb::arg("residual").none() = nb::none());
  m.def("simd", &simd_name);  // the matvec's instruction set in this build: avx2, neon or portable
  m.def("q8_simd", &q8_simd_name);  // the fast path's: avx2 or portable
  // The process's numerics (docs/numerics.md): "exact" or "fast", read by every product after.
  m.def("set_numerics", [](const std::string& numerics) {
    if (numerics != "exact" && numerics != "fast") throw std::invalid_argument("numerics must be exact or fast");
    fast_numerics().store(numerics == "fast");
  });
  m.def("numerics", []() { return fast_numerics().load() ? "fast" : "exact"; });
  m.def("read_seconds", &read_seconds, nb::arg("a"));
  m.def("quantized_matvecs", &quantized_matvecs, nb::arg("x"), nb::arg("w"), nb::arg("scales"), nb::arg("biases"),
        nb::arg("group_size"), nb::arg("bits"), nb::arg("widths"), nb::arg("split") = true,
        nb::arg("norm").none() = nb::none(), nb::arg("eps") = 0.0f);
  m.def("rms_norm", &rms_norm, nb::arg("x"), nb::arg("weight"), nb::arg("eps"));
  m.def("rope", &rope, nb::arg("x"), nb::arg("cos"), nb::arg("sin"), nb::arg("offset"), nb::arg("dims"),
        nb::arg("traditional"));
  m.def("attention", &attention, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("mask").none(), nb::arg("scale"),
        nb::arg("causal") = false, nb::arg("each_row") = false);
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
