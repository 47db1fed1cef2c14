// The kernels other instruction sets must also build, for tests/test_isa_builds.py: the GGUF
// kernels (gguf_quants.cpp) and the paged decode attention (paged_attention.cpp), built for
// another instruction set without the extension's other sources.
#include <torch/extension.h>

#include "tidal_cpu.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gguf_linear", [](at::Tensor x, at::Tensor w, int64_t type, bool planar,
                          c10::optional<at::Tensor> bias, bool rounds) {
    return tidal_cpu::gguf_linear(x, tidal_cpu::GGUFPart{w, type, planar, rounds},
                                  bias.value_or(at::Tensor()));
  }, py::arg("x"), py::arg("w"), py::arg("type"), py::arg("planar"),
        py::arg("bias") = py::none(), py::arg("rounds") = false);
  m.attr("gguf_nibble_rounds") = tidal_cpu::gguf_nibble_rounds();
  m.def("paged_decode_attention", [](at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                     at::Tensor tables, at::Tensor lens, double scale,
                                     int64_t window) {
    return tidal_cpu::paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, window,
                                             at::Tensor());
  });
}
