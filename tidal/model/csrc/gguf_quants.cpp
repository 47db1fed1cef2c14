// GGUF-quantized weights at decode sizes: y = x @ W^T with W in its GGUF block format
// (gguf_formats.h), as ggml multiplies them: x rounded to int8 with a float scale per 32
// values (gguf_activations.h), integer products, float multiply-adds per block and row (the
// K-quants: gguf_kdot_vnni.h, gguf_kdot.h), from some rows on a panel of 16 weight rows at a time
// (gguf_int8_panels.h: AMX's int8 tiles, or VNNI). Steps of more rows than the integer
// kernels take multiply bf16 weights by x in bf16 (`tiled`):
// where the CPU has AVX512-BF16, a panel of 16 weight rows at a time (gguf_bf16_panels.h:
// AMX tiles, or VDPBF16PS), else (and for steps of very many rows) through oneDNN over
// tiles of dequantized rows.

#include "tidal_cpu.h"
#include "gguf_formats.h"
#include "gguf_bf16_panels.h"
#include "gguf_int8_panels.h"
#include "gguf_dot32.h"
#include "gguf_dot8.h"
#include "gguf_dot_block.h"
#include "gguf_kdot.h"
#include "gguf_kdot_vnni.h"

#include <type_traits>
#include <utility>

namespace tidal_cpu {
namespace {

using namespace gguf;

constexpr int kMaxRows = 16;          // activation rows sharing each decoded weight group
// x interleaved in runs of kRun groups, for steps of at least kRunRows rows
// kLanes: the K-quants through kdot_lanes, over x as Activations::kx
#if defined(TIDAL_GGUF_DOT32)
constexpr int kRun = 16, kRunRows = 2;
constexpr bool kLanes = true;
#elif defined(TIDAL_GGUF_DOT8)
constexpr int kRun = 8, kRunRows = 1;
constexpr bool kLanes = false;
#else
constexpr int kRun = 0, kRunRows = 1;
constexpr bool kLanes = false;
#endif

// The most activation rows a kernel takes at once: the VNNI kernels keep 8 rows' sums in
// registers beside a block's weights (16 spill them: a step of 16 runs 8 + 8 over a tile).
constexpr int64_t kRowsAPass = kLanes ? 8 : kMaxRows;

// Whether format F's kernel reads x in runs, for a part in the given layout.
template <typename F>
constexpr bool reads_runs(bool planar) {
#if defined(TIDAL_GGUF_DOT32)
  return planar && F::kBlock == kGroup;
#elif defined(TIDAL_GGUF_DOT8)
  return planar && F::kNibbles;
#else
  return false;
#endif
}

// Whether panels take a part of format F (gguf_panel.h: AMX tiles, bf16 panels): the
// 32-weight formats planar, the K-quants in either layout.
template <typename F>
constexpr bool amx_takes(bool planar) {
  return planar || F::kBlock != kGroup;
}

// A part's quants must lie as this build's kernels read them (gguf_formats.h).
template <typename F>
void check_layout(const GGUFPart& p) {
  const bool rounds = p.planar && kNibbleRounds && F::kNibbles;
  TORCH_CHECK(p.rounds == rounds, "a GGUF part of ggml type ", p.type, " has its quants ",
              p.rounds ? "in" : "not in", " rounds, but this build's kernels read them ",
              rounds ? "in rounds" : "as they lie");
}
constexpr int64_t kTileBytes = 1 << 18;  // weight bytes a task keeps in L2 across row groups


// y[r0 .. r0+NR, o0 .. o1): NR is a compile-time constant so the accumulators stay in registers.
template <typename F, typename T, int NR>
void dot_rows(const Activations& a, int64_t r0, const uint8_t* w, int64_t row_bytes, int64_t k,
              bool planar, const T* bias, int64_t o0, int64_t o1, T* y, int64_t n) {
  const int64_t nb = k / F::kBlock;
  for (int64_t o = o0; o < o1; ++o) {
    const Prefetch pf{w + o * row_bytes + kAheadBytes, row_bytes / nb};
    Field f[F::kFields];
    fields<F>(w + o * row_bytes, nb, planar, f);
    float out[NR] = {};  // each activation row's dot product with this weight row
    if constexpr (F::kBlock == 256) {
#if defined(TIDAL_GGUF_DOT32)
      kdot_lanes<F, NR>(a, r0, f, pf, nb, out);
#else
      kdot<F, NR>(a, r0, f, pf, nb, out);
#endif
    } else {
#if defined(TIDAL_GGUF_DOT32)
      if (planar) {
        dot32<F, NR>(a, r0, f, pf, nb, out);
      } else {
        dot_avx2<F, NR>(a, r0, f, pf, nb, out);
      }
#elif defined(TIDAL_GGUF_DOT8)
      if constexpr (std::is_same_v<F, Q8_0>) {  // gguf_dot8.h takes the nibble formats
        dot_avx2<F, NR>(a, r0, f, pf, nb, out);
      } else if (planar) {
        dot8<F, NR>(a, r0, f, nb, out);
      } else {
        dot_avx2<F, NR>(a, r0, f, pf, nb, out);
      }
#elif defined(TIDAL_GGUF_AVX2)
      dot_avx2<F, NR>(a, r0, f, pf, nb, out);
#else
      dot_scalar<F, NR>(a, r0, f, pf, nb, out);
#endif
    }
    for (int r = 0; r < NR; ++r)
      y[(r0 + r) * n + o] = round_to<T>(out[r] + (bias != nullptr ? f32(bias[o]) : 0.f));
  }
}

// dot_rows for nr (1..kMaxRows) rows.
template <typename F, typename T, int... N>
auto row_kernel(int64_t nr, std::integer_sequence<int, N...>) {
  static constexpr decltype(&dot_rows<F, T, 1>) kernels[] = {dot_rows<F, T, N + 1>...};
  return kernels[nr - 1];
}

// y[:, :w.size(0)] of a [rows, ld] output for one weight, over activations already quantized.
// panels (the step's scales, or null): whole panels of 16 weight rows through the int8
// panels (amx_takes), in AMX's tiles with `amx`.
template <typename F, typename T>
void linear(const Activations& a, int64_t rows, int64_t k, const Tensor& w, bool planar,
            StepScales* panels, bool amx, const T* b, T* yp, int64_t ld) {
  const int64_t n = w.size(0), row_bytes = w.size(1);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  int64_t first = 0;  // the first weight row the VNNI kernels take
#ifdef TIDAL_GGUF_DOT32
  if (panels != nullptr && amx_takes<F>(planar)) {
    first = n / 16 * 16;
    int8_panels_linear<F, T>(a, rows, *panels, wp, row_bytes, planar, amx, b, 0, first, yp,
                             ld);
  }
#endif
  const int64_t tile = std::max<int64_t>(8, kTileBytes / row_bytes);
  const int64_t passes = (rows + kRowsAPass - 1) / kRowsAPass;  // balanced passes over a tile
  const int64_t per_pass = (rows + passes - 1) / passes;
  at::parallel_for(first, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t o0 = begin; o0 < end; o0 += tile) {  // a tile's weights stay cached
      const int64_t o1 = std::min(end, o0 + tile);
      for (int64_t r0 = 0; r0 < rows; r0 += per_pass) {
        const int64_t nr = std::min<int64_t>(per_pass, rows - r0);
        const auto run = row_kernel<F, T>(nr, std::make_integer_sequence<int, kMaxRows>());
        run(a, r0, wp, row_bytes, k, planar, b, o0, o1, yp, ld);
      }
    }
  });
}

// Group j of block b as floats: v[i] = s * q[i] + m.
template <typename F>
inline void group_values(const Field* f, int64_t b, int j, const float* s, float m, float* v) {
#ifdef TIDAL_GGUF_AVX2
  const __m256i q = F::vec(f, b, j);
  const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
  const __m128i eighths[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  for (int c = 0; c < 4; ++c) {
    const __m256 qf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eighths[c]));
    _mm256_storeu_ps(v + 8 * c, _mm256_fmadd_ps(_mm256_set1_ps(s[c / 2]), qf, _mm256_set1_ps(m)));
  }
#else
  int8_t q[kGroup];
  F::scalar(f, b, j, q);
  for (int i = 0; i < kGroup; ++i) v[i] = s[i / 16] * static_cast<float>(q[i]) + m;
#endif
}

// Rows of W as floats into out: row r is W's row ids[r], or start + r without ids.
template <typename F, typename T>
void dequantize(const Tensor& w, bool planar, int64_t start, const int64_t* ids, Tensor& out) {
  const int64_t rows = out.size(0), k = out.size(1), row_bytes = w.size(1);
  const int64_t nb = k / F::kBlock;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
    float s[F::kGroups][2], m[F::kGroups], v[kGroup];
    for (int64_t r = r0; r < r1; ++r) {
      Field f[F::kFields];
      fields<F>(wp + (ids != nullptr ? ids[r] : start + r) * row_bytes, nb, planar, f);
      for (int64_t b = 0; b < nb; ++b) {
        F::scales(f, b, s, m);
        for (int j = 0; j < F::kGroups; ++j) {
          T* dst = op + r * k + (b * F::kGroups + j) * kGroup;
          if constexpr (std::is_same_v<T, float>) {
            group_values<F>(f, b, j, s[j], m[j], dst);
          } else {
            group_values<F>(f, b, j, s[j], m[j], v);
            for (int i = 0; i < kGroup; ++i) dst[i] = round_to<T>(v[i]);
          }
        }
      }
    }
  });
}

// k of a [n, row_bytes] weight of format F, checked against the row's bytes.
template <typename F>
int64_t row_length(const Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "GGUF weights must be contiguous [n, row_bytes] uint8");
  TORCH_CHECK(w.size(1) % F::kBytes == 0, "a GGUF row of ", w.size(1),
              " bytes is not a whole number of ", F::kBytes, "-byte blocks");
  return w.size(1) / F::kBytes * F::kBlock;
}

// Rows of a part into out (float or bf16): W's rows ids, or start .. start + out.size(0).
void rows_into(const GGUFPart& p, int64_t start, const Tensor& ids, Tensor& out) {
  with_format(p.type, [&](auto format) {
    using F = decltype(format);
    check_layout<F>(p);
    TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(1) == row_length<F>(p.data),
                "GGUF rows: out must be contiguous [rows, k]");
    const int64_t* idp = nullptr;
    if (ids.defined()) {
      TORCH_CHECK(ids.scalar_type() == at::kLong && ids.is_contiguous() &&
                      ids.numel() == out.size(0), "GGUF rows: ids must be [rows] int64");
      idp = ids.data_ptr<int64_t>();
      for (int64_t r = 0; r < ids.numel(); ++r)
        TORCH_CHECK(idp[r] >= 0 && idp[r] < p.data.size(0), "row ", idp[r], " is not in W");
    } else {
      TORCH_CHECK(start >= 0 && start + out.size(0) <= p.data.size(0),
                  "GGUF rows: out must lie within W's rows");
    }
    AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, out.scalar_type(), "gguf_rows", [&] {
      dequantize<F, scalar_t>(p.data, p.planar, start, idp, out);
    });
  });
}

// A new [max(rows, out_rows), k] tensor of `dtype` for x's rows, the rows past them zeros.
Tensor padded_like(const Tensor& x, at::ScalarType dtype, int64_t out_rows) {
  const int64_t rows = x.size(0);
  Tensor xs = at::empty({std::max(rows, out_rows), x.size(1)}, x.options().dtype(dtype));
  if (out_rows > rows) xs.narrow(0, rows, out_rows - rows).zero_();
  return xs;
}

// x ([rows, k], float or bf16) as the integer kernels see it, each group of 32 d * q, in
// `dtype` (float32 or bf16); `out_rows` (>= rows) pads the result with rows of zeros.
Tensor rounded(const Tensor& x, at::ScalarType dtype = at::kFloat, int64_t out_rows = 0) {
  const int64_t rows = x.size(0), k = x.size(1);
  Tensor xs = padded_like(x, dtype, out_rows);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "gguf_rounded", [&] {
    const Activations a = quantize<scalar_t>(x.data_ptr<scalar_t>(), rows, k, false, 0);
    const auto fill = [&](auto* out) {
      at::parallel_for(0, rows * k / kGroup, 256, [&](int64_t g0, int64_t g1) {
        for (int64_t g = g0; g < g1; ++g) {
          const float d = a.d[g];
          for (int64_t i = 0; i < kGroup; ++i)
            out[g * kGroup + i] = d * static_cast<float>(a.q[g * kGroup + i]);
        }
      });
    };
    if (dtype == at::kFloat) fill(xs.data_ptr<float>());
    else fill(xs.data_ptr<at::BFloat16>());
  });
  return xs;
}

// What rounding leaves of rows x (float32): rounded once more, it carries x's next 7 bits.
Tensor residual(const Tensor& x) { return x - rounded(x); }

// Steps of many rows: tiles of dequantized weight rows that oneDNN multiplies (the extra
// memory stays one tile however large the weight; the rows bucketed as every CPU GEMM's),
// or each panel's weights in bf16 (bf16_panels: the same products), by x
// rounded to the int8 grid the integer kernels use, the rows `twice` with their
// residual's rounding added. In float32 both paths compute the same sums up to float32
// rounding, so a sequence's tokens do not depend on whether its prompt ran in one step, in
// chunks or partly from the prefix cache; with tile_bf16 (CPUs whose bf16 GEMMs run 2-3x
// faster: AMX, Zen 4) x and the tile are rounded to bf16 too, ~0.3% apart, whatever x's
// dtype. bf16 keeps 8 bits of a value, fewer than the twice-rounded rows' ~15, so those
// rows are x itself there (and a step of prompt rows alone is x, rounded once to bf16).
Tensor tiled(const Tensor& x, const GGUFProjection& g, const Tensor& twice, bool bf16_out) {
  const bool panels = bf16_panels_take(x, g);  // x's rows then padded to whole tiles of 16
  const int64_t padded = panels ? (x.size(0) + 15) / 16 * 16 : x.size(0);
  Tensor xs;
  if (g.tile_bf16 && twice.defined()) {  // the rows twice (a pass's prompt rows, unique): x
    // always a copy: the decode rows below are rounded in it, never in the caller's x
    xs = padded_like(x, at::kBFloat16, padded);
    xs.narrow(0, 0, x.size(0)).copy_(x);
    if (twice.size(0) < x.size(0)) {  // the others (decode rows) on the int8 grid
      const Tensor others = at::ones({x.size(0)}, x.options().dtype(at::kBool))
                                .index_fill_(0, twice, false).nonzero().view(-1);
      xs.index_copy_(0, others, rounded(x.index_select(0, others)).to(at::kBFloat16));
    }
  } else if (g.tile_bf16) {  // float32 inputs too: AMX's GEMMs
    xs = rounded(x, at::kBFloat16, padded);
  } else {
    xs = rounded(x);
    if (twice.defined())  // what xs left of those rows, rounded
      xs.index_add_(0, twice, rounded(x.index_select(0, twice).to(at::kFloat) -
                                      xs.index_select(0, twice)));
  }
  // y in x's dtype (each product converted by the copy that places it), or in bf16, the
  // products' own, where the caller takes it and no bias is added
  const bool bf16 = bf16_out && g.tile_bf16 && !g.bias.defined();
  Tensor y = at::empty({x.size(0), g.out_features},
                       x.options().dtype(bf16 ? at::kBFloat16 : x.scalar_type()));
#ifdef TIDAL_GGUF_BF16_PANELS
  if (panels) {
    bf16_panels(xs, g, y);
    if (g.bias.defined()) y.add_(g.bias.to(y.scalar_type()));
    return y;
  }
#endif
  Tensor tile = at::empty({g.tile_rows, xs.size(1)}, xs.options());
  int64_t col = 0;
  for (const GGUFPart& p : g.parts) {
    for (int64_t a = 0; a < p.data.size(0); a += g.tile_rows) {
      const int64_t n = std::min(g.tile_rows, p.data.size(0) - a);
      Tensor t = tile.narrow(0, 0, n);
      rows_into(p, a, Tensor(), t);
      bucketed_into(xs, y.narrow(1, col + a, n), [&](const Tensor& in) {
        return at::linear(in, t);
      });
    }
    col += p.data.size(0);
  }
  if (g.bias.defined()) y.add_(g.bias.to(y.scalar_type()));
  return y;
}

}  // namespace

GGUFProjection::GGUFProjection(std::vector<GGUFPart> parts_, Tensor bias_, int64_t max_rows_,
                               int64_t twice_max_rows_, int64_t tile_rows_, bool tile_bf16_,
                               int64_t panel_rows_, bool bf16_panels_, bool amx_,
                               Tensor in_perm_)
    : parts(std::move(parts_)), bias(bias_), max_rows(max_rows_),
      twice_max_rows(twice_max_rows_), tile_rows(tile_rows_),
      panel_rows(gguf_int8_panels() ? panel_rows_ : 0), amx(amx_ && gguf_amx()),
      tile_bf16(tile_bf16_),
      bf16_panels(bf16_panels_ && gguf_bf16_panels()), in_perm(in_perm_) {
  bool takes = true;  // whether panels (int8, bf16) take every part
  TORCH_CHECK(!parts.empty() && tile_rows > 0, "a GGUF projection needs parts and tile_rows > 0");
  for (const GGUFPart& p : parts) {
    with_format(p.type, [&](auto format) {
      using F = decltype(format);
      const int64_t k = row_length<F>(p.data);
      check_layout<F>(p);
      if (in_features == 0) in_features = k;
      TORCH_CHECK(k == in_features, "GGUF parts of one projection must share in_features");
      k_quants = k_quants || F::kBlock != kGroup;
      runs = runs || reads_runs<F>(p.planar);
      takes = takes && amx_takes<F>(p.planar);
    });
    panels = panels && p.data.size(0) % 16 == 0;
    out_features += p.data.size(0);
  }
  TORCH_CHECK(!bias.defined() || bias.numel() == out_features, "bias must be [out_features]");
  TORCH_CHECK(!in_perm.defined() || (in_perm.scalar_type() == at::kLong &&
                                     in_perm.dim() == 1 && in_perm.numel() == in_features),
              "in_perm must be int64 [in_features]");
  if (!takes) panel_rows = 0, amx = false;
  bf16_panels = bf16_panels && tile_bf16 && takes && panels;
}

// rows x [rows, in_features] through the integer kernels, plus the bias when `bias`.
Tensor GGUFProjection::integer(const Tensor& x, bool with_bias) const {
  const int64_t rows = x.size(0);
  Tensor y = at::empty({rows, out_features}, x.options());
  if (rows == 0) return y;
  const bool int8_panels = panel_rows > 0 && rows >= panel_rows;
  // x interleaved only for the VNNI kernel's rows: none when the panels take every one
  const bool interleave = runs && rows >= kRunRows && !(int8_panels && panels);
  const bool k_lanes = kLanes && k_quants && !(int8_panels && panels);  // kdot_lanes' x
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "gguf_linear", [&] {
    const Activations a = quantize<scalar_t>(x.data_ptr<scalar_t>(), rows, in_features,
                                             k_quants, interleave ? kRun : 0, k_lanes);
    const Tensor b = with_bias && bias.defined() ? bias.to(x.scalar_type()) : Tensor();
    StepScales scales(a, rows);
    int64_t col = 0;
    for (const GGUFPart& p : parts) {
      with_format(p.type, [&](auto format) {
        linear<decltype(format), scalar_t>(a, rows, in_features, p.data, p.planar,
                                           int8_panels ? &scales : nullptr, amx,
                                           b.defined() ? b.data_ptr<scalar_t>() + col : nullptr,
                                           y.data_ptr<scalar_t>() + col, out_features);
      });
      col += p.data.size(0);
    }
  });
  return y;
}

Tensor GGUFProjection::operator()(const Tensor& x_in, const Tensor& twice_in,
                                  bool bf16_out) const {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == in_features, "a GGUF projection takes [rows, ",
              in_features, "] inputs");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16,
              "GGUF projections take float32 or bfloat16 inputs");
  const Tensor x = in_perm.defined() ? x_in.index_select(1, in_perm) : x_in.contiguous();
  const int64_t rows = x.size(0);
  Tensor twice;  // index_select and index_add check its values against x's rows
  if (twice_in.defined() && twice_in.numel() > 0) {
    TORCH_CHECK(twice_in.dim() == 1, "rows to round twice must be [n] indices of x's rows");
    twice = twice_in.to(at::kLong);
  }
  const int64_t n = twice.defined() ? twice.size(0) : 0;
  if (rows + n > (n > 0 ? twice_max_rows : max_rows))
    return tiled(x, *this, twice, bf16_out);
  if (n == 0) return integer(x, true);
  // each row to round twice as two: x rounded, then what that rounding left, rounded
  const Tensor xf = x.to(at::kFloat);
  const Tensor y = integer(at::cat({xf, residual(xf.index_select(0, twice))}), false);
  Tensor out = y.narrow(0, 0, rows).index_add(0, twice, y.narrow(0, rows, n));
  if (bias.defined()) out.add_(bias.to(at::kFloat));
  return out.to(x.scalar_type());
}

Tensor gguf_linear(const Tensor& x, const GGUFPart& w, const Tensor& bias) {
  TORCH_CHECK(x.dim() == 2, "gguf_linear takes [rows, k] inputs");
  TORCH_CHECK(!bias.defined() || bias.scalar_type() == x.scalar_type(),
              "bias must be in x's dtype");
  const GGUFProjection g({w}, bias, x.size(0), 0, 1, false);
  return g(x);
}

void gguf_get_rows(const GGUFPart& w, const Tensor& ids, Tensor out) {
  rows_into(w, 0, ids.to(at::kLong).contiguous(), out);
}

bool gguf_nibble_rounds() { return kNibbleRounds; }

#ifdef TIDAL_GGUF_AMX_BF16
bool gguf_amx_bf16() { return amx_allowed(); }
#else
bool gguf_amx_bf16() { return false; }
#endif

#ifdef TIDAL_GGUF_BF16_PANELS
bool gguf_bf16_panels() { return true; }
#else
bool gguf_bf16_panels() { return false; }
#endif

#ifdef TIDAL_GGUF_DOT32
bool gguf_int8_panels() { return true; }
#else
bool gguf_int8_panels() { return false; }
#endif

#ifdef TIDAL_GGUF_AMX
bool gguf_amx() { return amx_allowed(); }
#else
bool gguf_amx() { return false; }
#endif

}  // namespace tidal_cpu
