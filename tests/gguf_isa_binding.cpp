// The GGUF kernels alone, for tests/test_gguf_isa.py: gguf_quants.cpp built for another
// instruction set needs none of the extension's other sources, so only it is compiled.
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
}
