// What the CPU decode path's files share: bf16/f32 conversions, dot, the Linear projection
// and the kernels that one file defines and another calls.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <tuple>
#include <vector>

using at::Tensor;
using c10::BFloat16;

namespace tidal_cpu {

// Conversions written on the bits so loops over them vectorise; bf16 rounds to nearest even
// as c10::BFloat16 does (NaN stays NaN).
template <typename T>
inline float f32(T x) { return static_cast<float>(x); }
inline float f32(BFloat16 x) {
  uint32_t u = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

template <typename T>
inline T round_to(float x) { return static_cast<T>(x); }
template <>
inline BFloat16 round_to<BFloat16>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  uint16_t bits = (u & 0x7fffffffu) > 0x7f800000u
                      ? uint16_t(0x7fc0)
                      : static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  return BFloat16(bits, BFloat16::from_bits());
}

// Dot product over d with 16 independent partial sums (vectorises without -ffast-math).
template <typename A, typename B>
inline float dot(const A* q, const B* k, int64_t d) {
  float acc[16] = {0.f};
  int64_t i = 0;
  for (; i + 16 <= d; i += 16)
    for (int j = 0; j < 16; ++j) acc[j] += f32(q[i + j]) * f32(k[i + j]);
  float s = 0.f;
  for (; i < d; ++i) s += f32(q[i]) * f32(k[i]);
  for (int j = 0; j < 16; ++j) s += acc[j];
  return s;
}

// linear.py's ROW_CHUNK and row_bucket: oneDNN and PyTorch cache a primitive per matrix
// shape, each holding buffers of about rows x outputs, so every GEMM over a step's rows sees
// a bounded set of row counts: exact up to 16, then 8 sizes an octave, chunks of 256.
constexpr int64_t kRowChunk = 256;

inline int64_t row_bucket(int64_t rows) {
  if (rows <= 16) return rows;
  const int64_t step = int64_t{1} << (64 - __builtin_clzll(rows - 1) - 4);
  return (rows + step - 1) / step * step;
}

// gemm(rows) over x's rows in chunks of kRowChunk, each padded with zero rows to its bucket.
template <typename Gemm>
Tensor bucketed(const Tensor& x, Gemm&& gemm) {
  const int64_t rows = x.size(0);
  if (rows > kRowChunk) {
    std::vector<Tensor> parts;
    for (const Tensor& part : x.split(kRowChunk)) parts.push_back(bucketed(part, gemm));
    return at::cat(parts);
  }
  const int64_t padded = row_bucket(rows);
  const Tensor y = gemm(padded == rows ? x : at::constant_pad_nd(x, {0, 0, 0, padded - rows}));
  return padded == rows ? y : y.narrow(0, 0, rows);
}

// bucketed(x, gemm) written into out (x's rows; a strided view, or another dtype, which the
// copy converts to), each chunk's product as it comes: no concatenation of the chunks.
template <typename Gemm>
void bucketed_into(const Tensor& x, Tensor out, Gemm&& gemm) {
  for (int64_t r0 = 0; r0 < x.size(0); r0 += kRowChunk) {
    const int64_t rows = std::min(kRowChunk, x.size(0) - r0);
    out.narrow(0, r0, rows).copy_(bucketed(x.narrow(0, r0, rows), gemm));
  }
}

// ---------------------------------------------------------------- experts (experts.cpp)

// Per expert e, xs[ends[e-1]:ends[e]] @ w[e]: float32 xs [rows, k] grouped by expert, ends
// [E] cumulative row counts, w [E, k, n].
Tensor grouped_linear(const Tensor& xs, const Tensor& ends, const Tensor& w);

// ---------------------------------------------------------------- LoRA (lora.cpp)

// y[rows[i]] += (x[rows[i]] A_s^T) B_s^T, s the slot of row i (rows grouped by slot, `ends`
// cumulative counts); x [rows, k], y [rows, n], A [S, R, k], B^T [S, R, n], one dtype.
// `bounds`: the cumulative output counts of the P fused parts, part p using ranks
// [p R/P, (p+1) R/P) alone.
void lora_add(const Tensor& x, Tensor& y, const Tensor& a, const Tensor& b, const Tensor& rows,
              const Tensor& ends, const Tensor& bounds);

// ---------------------------------------------------------------- projections (linear.cpp)

// y = x @ W^T (+ bias) for int4 W: [rows, k] -> [rows, n] in x's dtype. q4: [n, k/2] bytes,
// scale_min: [n, k/32, 2] float16 (groups of 32, Q4_1).
Tensor int4_linear(const Tensor& x_in, const Tensor& q4, const Tensor& scale_min,
                   const Tensor& bias);

// One projection in whichever CPU form the Python side packed it: kind 0 = at::linear,
// 1 = oneDNN-packed bf16 weight, 2 = int4 (groups of 32) for <= max_rows rows, else `w`
// packed as in kind 1; `packed` and `scales_zeros` are torch's int4 layout or, with `q4`,
// int4_linear's. Kinds 1 and 2 with `w32` (a packed float32 copy) multiply inputs
// of >= fp32_rows rows in float32, as PackedLinear does. Kind 3 = `gguf`.
struct GGUFProjection;
struct Linear {
  int64_t kind = 0;
  std::shared_ptr<const GGUFProjection> gguf;
  Tensor w, bias, packed, scales_zeros, w32, bias32;
  int64_t max_rows = 0, fp32_rows = 0;
  int64_t fixed_rows = 0;  // > 0: x in calls of exactly this many rows (batch-invariant)
  bool q4 = false;

  Tensor operator()(const Tensor& x) const;

 private:
  Tensor product(const Tensor& x) const;
};

// ---------------------------------------------------------------- GGUF blocks (gguf_quants.cpp)

// One GGUF weight in its block format (ggml type id `type`: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
// Q4_K, Q5_K, Q6_K): data [n, row_bytes] uint8, each row its blocks as the file holds them,
// or with `planar` each block field in a plane of the row; `rounds`: a nibble format's
// quants plane in rounds of 8 blocks, as builds with AVX2 and no AVX-512 VNNI read it
// (gguf_formats.h; a part in the other layout is refused).
struct GGUFPart {
  Tensor data;
  int64_t type = 0;
  bool planar = false;
  bool rounds = false;
};

// y = x @ [W_0; W_1; ...]^T (+ bias), the parts' outputs side by side (fused q/k/v or
// gate/up whose parts differ in format): [rows, in_features] -> [rows, out_features] in x's
// dtype (float32 or bf16). Steps of at most max_rows rows: x rounded to int8 per 32 and
// integer products (from panel_rows rows by the int8 panels, gguf_int8_panels.h); larger
// ones multiply tiles of tile_rows dequantized rows by x rounded the same way, in float32
// (or, with tile_bf16, in bf16: with bf16_panels each panel of 16 weight rows,
// gguf_bf16_panels.h). A step with rows to
// round twice takes the integer kernels while its rows and their residuals number at most
// twice_max_rows.
struct GGUFProjection {
  std::vector<GGUFPart> parts;
  Tensor bias;
  int64_t max_rows = 0, twice_max_rows = 0, tile_rows = 0, in_features = 0, out_features = 0;
  int64_t panel_rows = 0;  // steps of at least this many rows take the int8 panels (0: never)
  bool amx = false;        // whether the int8 and bf16 panels multiply in AMX's tiles
  bool tile_bf16 = false;
  bool bf16_panels = false;  // whether the bf16 tiles' steps take bf16 panels (else oneDNN)
  bool k_quants = false;  // whether some part is a K-quant
  bool runs = false;      // whether some part's kernel reads x interleaved (Activations::qi)
  bool panels = true;     // whether every part's rows are whole panels of 16 (AMX takes all)
  // act-order GPTQ: the input features the parts' columns hold, in order (x is gathered into
  // it first; int64 [in_features]); undefined: their own order
  Tensor in_perm;

  GGUFProjection() = default;
  GGUFProjection(std::vector<GGUFPart> parts, Tensor bias, int64_t max_rows,
                 int64_t twice_max_rows, int64_t tile_rows, bool tile_bf16,
                 int64_t panel_rows = 0, bool bf16_panels = false, bool amx = false,
                 Tensor in_perm = Tensor());
  // y = x W^T (+ bias). Rows `twice` (indices into x's rows, or undefined) are rounded
  // twice: x's int8 rounding plus its residual's, ~15 bits a value instead of ~8. With
  // `bf16_out`, y is bf16 where bf16 tiles computed it (the same values, unconverted).
  Tensor operator()(const Tensor& x, const Tensor& twice = Tensor(),
                    bool bf16_out = false) const;
  Tensor integer(const Tensor& x, bool with_bias) const;  // every row by the integer kernels
};

// One weight, all rows through the integer kernel.
Tensor gguf_linear(const Tensor& x, const GGUFPart& w, const Tensor& bias);

// Rows ids of W as floats into out ([len(ids), k], float or bf16): an embedding lookup, and
// dequantized rows for Python.
void gguf_get_rows(const GGUFPart& w, const Tensor& ids, Tensor out);

// Whether this build reads planar nibble quants in rounds (GGUFPart::rounds).
bool gguf_nibble_rounds();
bool gguf_int8_panels();  // whether this build has the int8 panels (AVX-512 VNNI)
bool gguf_amx();  // whether GGUF projections may take AMX int8 tiles here
bool gguf_amx_bf16();  // ... and AMX bf16 tiles for steps of many rows
bool gguf_bf16_panels();  // whether this build multiplies GGUF panels in bf16 (AVX512-BF16)

// ---------------------------------------------------------------- paged attention
// (paged_attention.cpp; T float or BFloat16, each over caches of C = T, int8_t or F8: the
// rows of kv_rows.h, which also holds the KV write)

// q: rows of [heads, d] at `q_stride` apart; caches [blocks, block_size, hkv, row width];
// tables [B, W] int64; lens [B]. window > 0: only the last `window` positions of each
// context (a sliding-window layer). tree (nullptr: none) [B, 2] int64: a speculation tree's
// (start, bits): of the positions from start on, a row sees those whose bit is set.
template <typename T, typename C>
void paged_attention(const T* q, int64_t q_stride, const C* k_cache, const C* v_cache,
                     const int64_t* tables, int64_t table_width, const int64_t* lens,
                     const int64_t* tree, int64_t batch, int64_t heads, int64_t hkv, int64_t d,
                     int64_t block_size, float scale, int64_t window, T* out);

// A cache of the model's `dtype`, or of quantized rows, for heads of `d` values.
void check_cache(const Tensor& t, at::ScalarType dtype, int64_t d);
void check_tables(const Tensor& tables, const Tensor& lens, int64_t batch, int64_t num_blocks,
                  int64_t block_size);
// The tree rows' (start, bits) as a [B, 2] int64 tensor's data (nullptr: undefined).
const int64_t* tree_rows(Tensor& tree, int64_t batch);

// Paged decode attention on its own: the PyTorch path's decode attention on CPU.
Tensor paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables,
                              Tensor lens, double scale, int64_t window, Tensor tree);
// Causal attention of each sequence's new query rows over its paged context (prefill chunks
// after a cached prefix): the Triton kernel's arguments (tidal/model/kernels).
Tensor paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables,
                               Tensor starts, Tensor lens, double scale, int64_t max_query_len,
                               int64_t window);
// Whether it multiplies bf16 pairs (AVX512-BF16) over bf16 and quantized caches.
bool prefill_bf16_dots();

// ---------------------------------------------------------------- fused ops (fused_ops.cpp)

// The PyTorch path's RMSNorm, residual add + RMSNorm and RoPE + KV write on float32 or bf16
// rows, with the Triton kernels' arguments (tidal/model/kernels): new tensors (normed,
// and x + residual, in the residual's dtype: x may be bf16 under a float32 residual),
// except that rope_and_cache rotates qk in place and returns its q and k heads, after
// writing k and v at `slots` of the caches (of the model's dtype, bf16, or quantized rows:
// kv_rows.h).
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps);
std::tuple<Tensor, Tensor> fused_add_rms_norm(const Tensor& x, const Tensor& residual,
                                              const Tensor& weight, double eps);
std::tuple<Tensor, Tensor> rope_and_cache(Tensor qk, Tensor v, Tensor cos, Tensor sin,
                                          const Tensor& k_cache, const Tensor& v_cache,
                                          Tensor slots, int64_t num_q_heads);

// act = silu(gate) * up from gate_up [rows, 2 * inter] (float32 or bf16) in `dtype`, rounded
// as the eager ops round (ATen's SiLU on the gate converted to dtype, then the product).
Tensor silu_mul(const Tensor& gate_up, at::ScalarType dtype);

// ---------------------------------------------------------------- token masks (token_mask.cpp)

// In place: logits[r][t] = -inf where bit t % 32 of words[r][t / 32] is 0 (llguidance's
// bitmask layout), and for tokens past the words.
void apply_token_bitmask(Tensor logits, const Tensor& words);

// ---------------------------------------------------------------- all-reduce (all_reduce.cpp)

// The sum over the tensor-parallel ranks of one machine, through the shared segment at
// `base` that tidal/model/shm_all_reduce.py creates and lays out: a 64-byte line per rank
// whose first int64 is the last call that rank published, then two sets of `size` float32
// slots of `slot_floats`. Bit for bit the Python path's sums (rank order, float32), and
// the call numbers are the segment's, so the two paths may take turns.
struct ShmReduce {
  uint8_t* base = nullptr;
  int64_t rank = 0, size = 1, slot_floats = 0;
  double timeout_s = 60;

  // y (float32 or bf16, contiguous) := its sum over the ranks, in place.
  void operator()(Tensor& y) const;
};

}  // namespace tidal_cpu
