// Structured outputs' token masks on CPU (tidal/engine/structured.py): a grammar's bitmask
// applied to a step's logits in one pass, where eager PyTorch ops take several (unpack,
// convert, add) and llguidance's own kernel is compiled by torch.compile on first use.

#include "tidal_cpu.h"

#include <array>
#include <limits>

namespace tidal_cpu {
namespace {

// For each byte of a mask word, what its 8 tokens' logits get added: 0 (allowed) or -inf.
const std::array<std::array<float, 8>, 256> kByteTable = [] {
  std::array<std::array<float, 8>, 256> table{};
  for (int byte = 0; byte < 256; ++byte)
    for (int j = 0; j < 8; ++j)
      table[byte][j] = (byte >> j) & 1 ? 0.f : -std::numeric_limits<float>::infinity();
  return table;
}();

}  // namespace

void apply_token_bitmask(Tensor logits, const Tensor& words) {
  TORCH_CHECK_VALUE(logits.scalar_type() == at::kFloat && logits.dim() == 2 &&
                        logits.stride(1) == 1,
                    "logits must be float32 rows, contiguous along the vocabulary");
  TORCH_CHECK_VALUE(words.scalar_type() == at::kInt && words.dim() == 2 &&
                        words.size(0) == logits.size(0),
                    "the bitmask must be int32 [rows, words], a row per logits row");
  const Tensor w = words.contiguous();
  const int64_t rows = logits.size(0), width = logits.size(1), nwords = w.size(1);
  float* lp = logits.data_ptr<float>();
  const int64_t stride = logits.stride(0);
  const auto* wp = reinterpret_cast<const uint32_t*>(w.data_ptr<int32_t>());
  const float ninf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = lp + r * stride;
      const uint32_t* bits = wp + r * nwords;
      for (int64_t k = 0; k * 32 < width; ++k) {  // token t: bit t % 32 of word t / 32
        const uint32_t word = k < nwords ? bits[k] : 0u;  // past the mask: not allowed
        if (word == 0xffffffffu) continue;  // all allowed
        float* out = row + k * 32;
        const int64_t n = std::min<int64_t>(32, width - k * 32);
        if (word == 0u) {  // none allowed: most words of a grammar's mask
          std::fill_n(out, n, ninf);
          continue;
        }
        if (n == 32) {  // adds of 0 or -inf, 8 a byte from the table: no branch
          for (int b = 0; b < 4; ++b) {
            const float* add = kByteTable[(word >> (8 * b)) & 255u].data();
            for (int j = 0; j < 8; ++j) out[8 * b + j] += add[j];
          }
        } else {
          for (int64_t i = 0; i < n; ++i) out[i] = ((word >> i) & 1u) ? out[i] : ninf;
        }
      }
    }
  });
}

}  // namespace tidal_cpu
