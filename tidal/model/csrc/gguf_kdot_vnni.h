// K-quant rows (Q4_K, Q5_K, Q6_K) against activations rounded to int8 (gguf_activations.h),
// with AVX-512 VNNI. Lane i of step t (0-3) holds weights 16 i + 4 t .. 16 i + 4 t + 3 of
// a block, and x is kept in that order (Activations::kx), so one lane's products over the
// four steps all belong to one sub-block (Q6_K: lane i is sub-block i of 16; the others:
// lanes 2j and 2j + 1 are sub-block j of 32). Four VNNI dot products a row then sum a
// block's lanes in int32, and one float multiply-add scales them (the sub-block's scale
// times d, per block, times x's group scale), where unpacking products in
// pairs needs an integer scale per pair and step. The weights' lanes are gathered once per
// block for every activation row; a row's result is the same at any number of rows.

#pragma once

#include "gguf_kdot.h"

#ifdef TIDAL_GGUF_DOT32

namespace tidal_cpu {
namespace gguf {

// Where lane i of step t finds its 4 quants: dword idx[t][i] of a field, bits from shift[i].
struct alignas(64) LaneTable {
  int32_t idx[4][16];
  int32_t shift[16];
};

template <typename Dword, typename Shift>
constexpr LaneTable lane_table(Dword dword, Shift shift) {
  LaneTable table{};
  for (int t = 0; t < 4; ++t)
    for (int i = 0; i < 16; ++i) table.idx[t][i] = dword(i) + t;
  for (int i = 0; i < 16; ++i) table.shift[i] = shift(i);
  return table;
}

// Q4_K, Q5_K (lane i in sub-block j = i / 2, weights 16 (i % 2) + 4t ..): qs dword
// 8 (j / 2) + 4 (i % 2) + t, nibble j % 2; Q5_K's fifth bit j of qh dword 4 (i % 2) + t.
inline constexpr LaneTable kQsLanes = lane_table(
    [](int i) { return 8 * (i / 4) + 4 * (i % 2); }, [](int i) { return 4 * (i / 2 % 2); });
inline constexpr LaneTable kQhLanes5 = lane_table(
    [](int i) { return 4 * (i % 2); }, [](int i) { return i / 2; });
// Q6_K (lane i in half h = i / 8, c = i % 8 / 2): ql dword 16 h + 8 (c % 2) + 4 (i % 2) + t,
// nibble c / 2; qh dword 8 h + 4 (i % 2) + t, bits 2c and 2c + 1 (ggml's dequantize order).
inline constexpr LaneTable kQlLanes6 = lane_table(
    [](int i) { return 16 * (i / 8) + 8 * (i % 8 / 2 % 2) + 4 * (i % 2); },
    [](int i) { return 4 * (i % 8 / 4); });
inline constexpr LaneTable kQhLanes6 = lane_table(
    [](int i) { return 8 * (i / 8) + 4 * (i % 2); }, [](int i) { return 2 * (i % 8 / 2); });

// Step t's bytes of a field in two registers (lo: dwords 0-15, hi: 16-31), masked.
TIDAL_INLINE __m512i gather_lanes(__m512i lo, __m512i hi, const LaneTable& table, int t, int mask) {
  const __m512i v = _mm512_permutex2var_epi32(lo, _mm512_load_si512(table.idx[t]), hi);
  return _mm512_and_si512(_mm512_srlv_epi32(v, _mm512_load_si512(table.shift)),
                          _mm512_set1_epi8(static_cast<char>(mask)));
}

inline __m512i load64(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline __m256i load32(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
// Each of x's 8 group scales at d, for two lanes (lane i: d[i / 2])
TIDAL_INLINE __m512 twice(const float* d) {
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7),
                               _mm512_castps256_ps512(_mm256_loadu_ps(d)));
}
// 16 integer scales times a block's float16 d
TIDAL_INLINE __m512 times_d(__m512i scales, const uint8_t* d) {
  return _mm512_mul_ps(_mm512_cvtepi32_ps(scales), _mm512_set1_ps(fp16(d)));
}

// A block's quants by step (unsigned bytes), its lanes' scales (times d), and its offsets:
// the weights of x's sums of 16 (by_sums, times by: dmin, or 32 d for Q6_K's q - 32).
template <typename F>
struct KLanes;

template <bool kFive>
struct KLanes<QK<kFive>> {
  __m512i qs[2], qh;
  __m512 scales;
  __m256i by_sums;
  float by;
  KLanes(const Field* f, int64_t b) {
    const uint8_t* p = f[kFive ? 4 : 3].at(b);
    qs[0] = load64(p);
    qs[1] = load64(p + 64);
    if (kFive) qh = _mm512_zextsi256_si512(load32(f[3].at(b)));
    uint64_t s8, m8;
    k_scales_mins(f[2].at(b), s8, m8);
    const __m128i s = _mm_cvtsi64_si128(static_cast<int64_t>(s8));
    const __m128i m = _mm_cvtsi64_si128(static_cast<int64_t>(m8));
    scales = times_d(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(s, s)), f[0].at(b));  // 2 lanes each
    by_sums = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m, m));  // each min for two 16s
    by = fp16(f[1].at(b));
  }
  __m512i operator()(int t) const {
    __m512i q = gather_lanes(qs[0], qs[1], kQsLanes, t, 15);
    if (kFive) q = _mm512_or_si512(q, _mm512_slli_epi32(gather_lanes(qh, qh, kQhLanes5, t, 1), 4));
    return q;
  }
};

template <>
struct KLanes<Q6_K> {
  __m512i ql[2], qh;
  __m512 scales;
  __m256i by_sums;
  float by;
  KLanes(const Field* f, int64_t b) {
    ql[0] = load64(f[0].at(b));
    ql[1] = load64(f[0].at(b) + 64);
    qh = load64(f[1].at(b));
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(f[2].at(b)));
    scales = times_d(_mm512_cvtepi8_epi32(sc), f[3].at(b));
    by_sums = _mm256_cvtepi8_epi16(sc);
    by = 32.f * fp16(f[3].at(b));
  }
  __m512i operator()(int t) const {
    return _mm512_or_si512(gather_lanes(ql[0], ql[1], kQlLanes6, t, 15),
                           _mm512_slli_epi32(gather_lanes(qh, qh, kQhLanes6, t, 3), 4));
  }
};

// One weight row's K-quant blocks against NR activation rows; adds each dot product to
// out[r]. A lane's int32 sums 16 products (<= 63 * 127 each): exact as a float too.
template <typename F, int NR>
TIDAL_INLINE void kdot_lanes(const Activations& a, int64_t r0, const Field* f,
                             const Prefetch& pf, int64_t nb, float* out) {
  const int64_t groups = a.k / kGroup;
  const __m512i zero = _mm512_setzero_si512();
  __m512 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    pf.block(b);
    const KLanes<F> block(f, b);
    const W16 offsets(block.by_sums, block.by);
    __m512i q[4];
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) q[t] = block(t);
    for (int r = 0; r < NR; ++r) {
      const int64_t g = (r0 + r) * groups + b * 8;
      const int8_t* x = &a.kx[g * kGroup];
      __m512i dot = zero;
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t)
        dot = _mm512_dpbusd_epi32(dot, q[t], _mm512_loadu_si512(x + 64 * t));
      const __m512 scale = _mm512_mul_ps(block.scales, twice(&a.d[g]));
      acc[r] = offsets.fnma(&a.sum16[g * 2],
                            _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r]));
    }
  }
  for (int r = 0; r < NR; ++r) out[r] += fsum(acc[r]);
}

}  // namespace gguf
}  // namespace tidal_cpu
#endif
