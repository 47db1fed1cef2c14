// K-quant rows (Q4_K, Q5_K, Q6_K) against activations rounded to int8 per 32 values, each
// scale r_j * base (gguf_activations.h). A block's sub-block scales are small integers
// (6 bits, or int8 for Q6_K) times one float d, so with s_j = sc_j * r_j as int16:
// y += d * base * sum_j s_j * (q . x)_j - dmin * sum_j mn_j * sum(x_j): the products in
// integers to the block's end and one float multiply-add per block and row, the mins (and
// Q6_K's offset of 32) from the sums of each 16 of x as rounded, also one multiply-add.
//
// A step takes 64 weights (two sub-blocks of 32, or four of 16 for Q6_K): with AVX-512 one
// register, with AVX2 two; u8 x s8 products in pairs (maddubs), times the int16 scales
// (madd). The weights' bits are unpacked once per step for every activation row. Builds
// with AVX-512 VNNI take gguf_kdot_vnni.h's kernel instead (this file's helpers beside it).

#pragma once

#include "gguf_activations.h"
#include "gguf_formats.h"

#include <type_traits>

namespace tidal_cpu {
namespace gguf {

// Block b's 6-bit scales and mins (Q4_K, Q5_K) as 8 bytes each, from its 12 packed bytes:
// scales 0-3 and mins 0-3 are the low 6 bits of bytes 0-3 and 4-7; 4-7 take their low 4
// bits from bytes 8-11 and their top 2 from the top bits of bytes 0-3 (scales) or 4-7 (mins).
TIDAL_INLINE void k_scales_mins(const uint8_t* p, uint64_t& sc, uint64_t& mn) {
  uint32_t u[3];
  std::memcpy(u, p, sizeof u);
  sc = (u[0] & 0x3f3f3f3fu) |
       uint64_t((u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4)) << 32;
  mn = (u[1] & 0x3f3f3f3fu) |
       uint64_t(((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4)) << 32;
}

#if defined(TIDAL_GGUF_AVX2)
#if defined(__AVX512F__) && defined(__AVX512BW__)
// 64 int8 lanes in one register; "half" h is lanes 32h .. 32h + 31.
struct V64 {
  __m512i v;
  static V64 load(const void* p) { return {_mm512_loadu_si512(p)}; }
  // The 32 bytes at p in both halves, shifted right by a (low half) and b (high half) bits
  // in 16-bit lanes, then masked per byte.
  static V64 halves(const uint8_t* p, int a, int b, int mask) {
    const __m512i raw = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const __m512i by = _mm512_inserti64x4(_mm512_set1_epi16(static_cast<short>(a)),
                                          _mm256_set1_epi16(static_cast<short>(b)), 1);
    return {_mm512_and_si512(_mm512_srlv_epi16(raw, by), _mm512_set1_epi8(static_cast<char>(mask)))};
  }
  V64 shr(int n, int mask) const {
    return {_mm512_and_si512(_mm512_srli_epi16(v, n), _mm512_set1_epi8(static_cast<char>(mask)))};
  }
  V64 operator|(V64 o) const { return {_mm512_or_si512(v, o.v)}; }
  V64 shl4() const { return {_mm512_slli_epi16(v, 4)}; }
};
// A block's int16 scales (16 lanes); step t's 32 lanes: each of n (2 or 4) scales
// sc[n * t ..] over 32 / n lanes.
struct Scales {
  __m512i all;
  explicit Scales(__m256i sc) : all(_mm512_zextsi256_si512(sc)) {}
  __m512i step(int t, int n) const {
    alignas(64) static const int16_t kLanes[32] = {0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10,
                                                   11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21,
                                                   22, 23, 24, 25, 26, 27, 28, 29, 30, 31};
    const __m512i lane = _mm512_load_si512(kLanes);
    const __m512i idx = _mm512_add_epi16(_mm512_srli_epi16(lane, n == 2 ? 4 : 3),
                                         _mm512_set1_epi16(static_cast<short>(n * t)));
    return _mm512_permutexvar_epi16(idx, all);
  }
};
// 16 int32 partial sums.
struct I32 {
  __m512i v = _mm512_setzero_si512();
  void add(V64 q, const int8_t* x, __m512i s) {  // += s * (q . x): u8 x s8 pairs, int16 s
    v = _mm512_add_epi32(v, _mm512_madd_epi16(_mm512_maddubs_epi16(q.v, _mm512_loadu_si512(x)), s));
  }
  __m512 to_float() const { return _mm512_cvtepi32_ps(v); }
};
using F32 = __m512;
// 16 floats: a block's weights of the sums of each 16 of x.
struct W16 {
  __m512 v;
  W16(__m256i w, float by) : v(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(w)), _mm512_set1_ps(by))) {}
  F32 fnma(const float* sums, F32 acc) const { return _mm512_fnmadd_ps(_mm512_loadu_ps(sums), v, acc); }
};
inline F32 fzero() { return _mm512_setzero_ps(); }
inline F32 fma_by(F32 a, float s, F32 acc) { return _mm512_fmadd_ps(a, _mm512_set1_ps(s), acc); }
inline float fsum(F32 a) { return _mm512_reduce_add_ps(a); }
#else
struct V64 {
  __m256i lo, hi;
  static V64 load(const void* p) {
    const __m256i* v = reinterpret_cast<const __m256i*>(p);
    return {_mm256_loadu_si256(v), _mm256_loadu_si256(v + 1)};
  }
  static V64 halves(const uint8_t* p, int a, int b, int mask) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i m = _mm256_set1_epi8(static_cast<char>(mask));
    return {_mm256_and_si256(_mm256_srl_epi16(raw, _mm_cvtsi32_si128(a)), m),
            _mm256_and_si256(_mm256_srl_epi16(raw, _mm_cvtsi32_si128(b)), m)};
  }
  V64 shr(int n, int mask) const {
    const __m256i m = _mm256_set1_epi8(static_cast<char>(mask));
    const __m128i c = _mm_cvtsi32_si128(n);
    return {_mm256_and_si256(_mm256_srl_epi16(lo, c), m), _mm256_and_si256(_mm256_srl_epi16(hi, c), m)};
  }
  V64 operator|(V64 o) const { return {_mm256_or_si256(lo, o.lo), _mm256_or_si256(hi, o.hi)}; }
  V64 shl4() const { return {_mm256_slli_epi16(lo, 4), _mm256_slli_epi16(hi, 4)}; }
};
struct S64 {
  __m256i lo, hi;
};
struct Scales {
  alignas(32) int16_t sc[16];
  explicit Scales(__m256i v) { _mm256_store_si256(reinterpret_cast<__m256i*>(sc), v); }
  S64 step(int t, int n) const {
    const int16_t* s = sc + n * t;
    if (n == 2) return {_mm256_set1_epi16(s[0]), _mm256_set1_epi16(s[1])};
    return {_mm256_setr_m128i(_mm_set1_epi16(s[0]), _mm_set1_epi16(s[1])),
            _mm256_setr_m128i(_mm_set1_epi16(s[2]), _mm_set1_epi16(s[3]))};
  }
};
struct I32 {
  __m256i v = _mm256_setzero_si256();
  void add(V64 q, const int8_t* x, S64 s) {
    const __m256i* xv = reinterpret_cast<const __m256i*>(x);
    const __m256i lo = _mm256_madd_epi16(_mm256_maddubs_epi16(q.lo, _mm256_loadu_si256(xv)), s.lo);
    const __m256i hi = _mm256_madd_epi16(_mm256_maddubs_epi16(q.hi, _mm256_loadu_si256(xv + 1)), s.hi);
    v = _mm256_add_epi32(v, _mm256_add_epi32(lo, hi));
  }
  __m256 to_float() const { return _mm256_cvtepi32_ps(v); }
};
using F32 = __m256;
struct W16 {
  __m256 lo, hi;
  W16(__m256i w, float by)
      : lo(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(w))), _mm256_set1_ps(by))),
        hi(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(w, 1))), _mm256_set1_ps(by))) {}
  F32 fnma(const float* sums, F32 acc) const {
    return _mm256_fnmadd_ps(_mm256_loadu_ps(sums + 8), hi, _mm256_fnmadd_ps(_mm256_loadu_ps(sums), lo, acc));
  }
};
inline F32 fzero() { return _mm256_setzero_ps(); }
inline F32 fma_by(F32 a, float s, F32 acc) { return _mm256_fmadd_ps(a, _mm256_set1_ps(s), acc); }
inline float fsum(F32 a) { return hsum(a); }
#endif

// The block's 64 quants of step t (0-3) as unsigned bytes, for each format.
template <typename F>
struct KSteps;

template <bool kFive>
struct KSteps<QK<kFive>> {
  static constexpr int kScales = 2;  // sub-blocks of 32 a step
  const uint8_t* qs;
  const uint8_t* qh;
  KSteps(const Field* f, int64_t b) : qs(f[kFive ? 4 : 3].at(b)), qh(kFive ? f[3].at(b) : nullptr) {}
  V64 operator()(int t) const {  // nibbles of qs[32t ..]: low ones sub-block 2t, high 2t + 1
    V64 q = V64::halves(qs + 32 * t, 0, 4, 15);
    if (kFive) q = q | V64::halves(qh, 2 * t, 2 * t + 1, 1).shl4();  // fifth bit: qh bit j
    return q;
  }
};

template <>
struct KSteps<Q6_K> {
  static constexpr int kScales = 4;  // sub-blocks of 16 a step
  const uint8_t* ql;
  const uint8_t* qh;
  KSteps(const Field* f, int64_t b) : ql(f[0].at(b)), qh(f[1].at(b)) {}
  V64 operator()(int t) const {  // weights 64t ..: half h = t / 2, nibble and qh pair by t % 2
    const int h = t / 2, p = t % 2;
    const V64 lo = V64::load(ql + 64 * h).shr(4 * p, 15);
    return lo | V64::halves(qh + 32 * h, 4 * p, 4 * p + 2, 3).shl4();
  }
};

// Activation row r's scale ratios for block b's sub-blocks (gguf_activations.h): 8 int16,
// or each twice (16) for Q6_K's sub-blocks of 16.
template <bool kTwice>
TIDAL_INLINE __m256i ratios(const Activations& a, int64_t g) {
  const __m128i r = _mm_loadu_si128(reinterpret_cast<const __m128i*>(&a.r[g]));
  if (kTwice) return _mm256_setr_m128i(_mm_unpacklo_epi16(r, r), _mm_unpackhi_epi16(r, r));
  return _mm256_zextsi128_si256(r);
}

// One weight row's K-quant blocks against NR activation rows; adds each dot product to out[r].
// Per block and row the int16 scales are the weight's times the row's ratios r (<= 63 * 128
// or 128 * 128), so every sum stays int32 (a lane: 4 steps of 4 products, 16 * 63 * 127 *
// 16384 < 2^31).
template <typename F, int NR>
TIDAL_INLINE void kdot(const Activations& a, int64_t r0, const Field* f,
                       const Prefetch& pf, int64_t nb, float* out) {
  constexpr bool kQ6 = std::is_same_v<F, Q6_K>;
  const int64_t groups = a.k / kGroup, bases = a.bases_per_row();
  F32 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = fzero();
  for (int64_t b = 0; b < nb; ++b) {
    pf.block(b);
    float d;
    __m256i sc, by_sums;  // int16: the sub-blocks' scales; the weights of each 16's sum of x
    float by;             // what multiplies by_sums: dmin, or 32 d for Q6_K's q - 32
    if constexpr (kQ6) {
      sc = by_sums = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(f[2].at(b))));
      d = fp16(f[3].at(b));
      by = 32.f * d;
    } else {
      uint64_t s8, m8;
      k_scales_mins(f[2].at(b), s8, m8);
      sc = _mm256_zextsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<int64_t>(s8))));
      const __m128i m = _mm_cvtsi64_si128(static_cast<int64_t>(m8));
      by_sums = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m, m));  // each min for two 16s
      d = fp16(f[0].at(b));
      by = fp16(f[1].at(b));
    }
    const W16 offsets(by_sums, by);
    const KSteps<F> steps(f, b);
    V64 q[4];  // the block's weights, unpacked once for every row
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) q[t] = steps(t);
    for (int r = 0; r < NR; ++r) {
      const int64_t g = (r0 + r) * groups + b * 8;
      const Scales scales(_mm256_mullo_epi16(sc, ratios<kQ6>(a, g)));
      I32 dot;
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t)
        dot.add(q[t], &a.q[(g + 2 * t) * kGroup], scales.step(t, KSteps<F>::kScales));
      acc[r] = offsets.fnma(&a.sum16[g * 2],
                            fma_by(dot.to_float(), d * a.base[(r0 + r) * bases + b], acc[r]));
    }
  }
  for (int r = 0; r < NR; ++r) out[r] += fsum(acc[r]);
}
#else
// The same without AVX2, a sub-block of 32 at a time in float.
template <typename F, int NR>
TIDAL_INLINE void kdot(const Activations& a, int64_t r0, const Field* f,
                       const Prefetch& pf, int64_t nb, float* out) {
  float s[8][2], m[8];
  int8_t q[32];
  for (int64_t b = 0; b < nb; ++b) {
    pf.block(b);
    F::scales(f, b, s, m);
    for (int j = 0; j < 8; ++j) {
      F::scalar(f, b, j, q);
      for (int r = 0; r < NR; ++r) {
        const int64_t g = (r0 + r) * (a.k / kGroup) + b * 8 + j;
        const int8_t* x = &a.q[g * kGroup];
        int32_t lo = 0, hi = 0;
        for (int i = 0; i < 16; ++i) {
          lo += q[i] * x[i];
          hi += q[i + 16] * x[i + 16];
        }
        out[r] += a.d[g] * (s[j][0] * lo + s[j][1] * hi) +
                  m[j] * (a.sum16[g * 2] + a.sum16[g * 2 + 1]);
      }
    }
  }
}
#endif

}  // namespace gguf
}  // namespace tidal_cpu
