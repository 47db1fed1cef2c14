// The 32-weight formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), planar, with AVX-512 VNNI: their
// quants as unsigned bytes u = q + c (c: 128 for Q8_0's int8, 0 for the nibble formats,
// whose centre 8 or 16 is then part of the offset). Per block b and activation row:
// y += d_b * dx_b * (u . x) + (m_b - c * d_b) * sum(x_b), the sums those of x as rounded;
// the products VNNI dot products, sixteen blocks (or two, see dot32) at a time.

#pragma once

#include "gguf_activations.h"
#include "gguf_formats.h"

#include <type_traits>

#ifdef TIDAL_GGUF_DOT32  // (gguf_formats.h: AVX-512 VNNI)

namespace tidal_cpu {
namespace gguf {

// A planar row's blocks b (low half) and b + 1 (high half; zero unless `both`) of F as
// unsigned bytes, and the centre u carries: u = w / d + kCentre - m / d.
template <typename F>
struct Unsigned32 {
  static constexpr int centre() {
    if constexpr (std::is_same_v<F, Q8_0>) return 128;
    else return F::kOffset;
  }
  static constexpr int kCentre = centre();
  TIDAL_INLINE static __m512i pair(const Field* f, int64_t b, bool both) {
    if constexpr (std::is_same_v<F, Q8_0>) {
      const __m512i q = both ? _mm512_loadu_si512(f[1].at(b))
                             : _mm512_zextsi256_si512(_mm256_loadu_si256(
                                   reinterpret_cast<const __m256i*>(f[1].at(b))));
      return _mm512_xor_si512(q, both ? _mm512_set1_epi8(static_cast<char>(0x80))
                                      : _mm512_zextsi256_si512(_mm256_set1_epi8(static_cast<char>(0x80))));
    } else {
      const uint8_t* qs = f[F::kFields - 1].at(b);  // 16 bytes a block, the pair's adjacent
      const __m256i raw = both ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs))
                               : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
      const __m256i lo = _mm256_and_si256(raw, _mm256_set1_epi8(15));
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), _mm256_set1_epi8(15));
      // [lo b, lo b+1, hi b, hi b+1] -> [lo b, hi b, lo b+1, hi b+1]: each block's 32 weights
      __m512i q = _mm512_shuffle_i64x2(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1),
                                       _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1),
                                       _MM_SHUFFLE(3, 1, 2, 0));
      if constexpr (F::kFiveBits) {
        const uint8_t* qh = f[F::kFields - 2].at(b);
        const __m256i h1 = both ? high_bits(u32(qh + 4)) : _mm256_setzero_si256();
        q = _mm512_or_si512(q, _mm512_inserti64x4(_mm512_castsi256_si512(high_bits(u32(qh))), h1, 1));
      }
      return q;
    }
  }
};

// Dword permutes that gather 16 blocks' dwords, from pairs of registers each holding 2, 4
// or 8 blocks' dwords (8, 4, 2 a block), into registers holding twice the blocks and half
// the dwords each: [round][half], half 0 the low dwords of each block, half 1 the high.
alignas(64) inline constexpr int32_t kGather[3][2][16] = {
    {{0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27},     // 4 blocks, dwords 0-3
     {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31}},  // and 4-7
    {{0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29},     // 8 blocks, 2 dwords
     {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31}},
    {{0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30},    // 16 blocks, 1 dword
     {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31}}};

TIDAL_INLINE __m512i gather(__m512i x, int round, int half, __m512i y) {
  return _mm512_permutex2var_epi32(x, _mm512_load_si512(kGather[round][half]), y);
}

// 16 blocks' unpacked quants transposed: from P[t] (blocks 2t and 2t + 1, eight dwords of
// four weights each) to C[i], whose lane l is dword i of block l (weights 4i .. 4i + 3).
TIDAL_INLINE void transpose16(const __m512i* P, __m512i* C) {
  __m512i four[2][4], eight[2][4];  // [dword half][blocks 4s ..]; [block half][dword pair]
  for (int s = 0; s < 4; ++s)
    for (int h = 0; h < 2; ++h) four[h][s] = gather(P[2 * s], 0, h, P[2 * s + 1]);
  for (int h = 0; h < 2; ++h)
    for (int p = 0; p < 4; ++p)
      eight[h][p] = gather(four[p / 2][2 * h], 1, p % 2, four[p / 2][2 * h + 1]);
  for (int p = 0; p < 4; ++p)
    for (int e = 0; e < 2; ++e) C[2 * p + e] = gather(eight[0][p], 2, e, eight[1][p]);
}

// The same walk summing instead of keeping: from S[t] (blocks 2t and 2t + 1, eight int32
// partial sums each) to one register whose lane l is block l's whole sum, the integer that
// the transposed path's lane l holds, so one row and many sum a block alike.
TIDAL_INLINE __m512i fold(__m512i x, int round, __m512i y) {
  return _mm512_add_epi32(gather(x, round, 0, y), gather(x, round, 1, y));
}
// Its last two rounds: from four registers of 4 blocks x 4 partial sums.
TIDAL_INLINE __m512i reduce_fours(const __m512i* four) {
  return fold(fold(four[0], 1, four[1]), 2, fold(four[2], 1, four[3]));
}
TIDAL_INLINE __m512i reduce16(const __m512i* S) {
  __m512i four[4];  // 4 blocks x 4 partials
  for (int s = 0; s < 4; ++s) four[s] = fold(S[2 * s], 0, S[2 * s + 1]);
  return reduce_fours(four);
}

// The 4-bit formats (Q4_0, Q4_1): a block's 16 bytes hold weight i (low nibble) and i + 16
// (high).
template <typename F>
constexpr bool four_bit_nibbles() {
  if constexpr (F::kNibbles) return !F::kFiveBits;
  else return false;
}

// One row's sums of 16 blocks of a 4-bit format, as reduce16 leaves them: four adjacent
// blocks' 64 bytes, masked and shifted, hold weights 0-15 and 16-31 of the four at the same
// lanes, and x's halves paired alike make two VNNI products that leave each block's sum in
// 4 dwords, reduce16's first round, without unpacking the pairs or that round's permutes.
TIDAL_INLINE __m512i nibble_sums16(const uint8_t* qs, const int8_t* x) {
  const __m512i low = _mm512_set1_epi8(15);
  __m512i four[4];
  for (int s = 0; s < 4; ++s) {
    const __m512i raw = _mm512_loadu_si512(qs + 64 * s);
    const __m512i x0 = _mm512_loadu_si512(x + 128 * s), x1 = _mm512_loadu_si512(x + 128 * s + 64);
    const __m512i first = _mm512_shuffle_i64x2(x0, x1, _MM_SHUFFLE(2, 0, 2, 0));  // 0-15
    const __m512i last = _mm512_shuffle_i64x2(x0, x1, _MM_SHUFFLE(3, 1, 3, 1));   // 16-31
    four[s] = _mm512_dpbusd_epi32(
        _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(raw, low), first),
        _mm512_and_si512(_mm512_srli_epi16(raw, 4), low), last);
  }
  return reduce_fours(four);
}

// One planar row's blocks against NR activation rows; adds each dot product to out[r].
// Sixteen blocks a round: transposed (above) against x interleaved the same way
// (Activations::qi), each lane one block's products, so eight VNNI dot products a row sum
// 512 weights in int32 and one conversion and multiply-add scale them. One row (x not
// interleaved) takes two blocks a dot product and sums each block's lanes (reduce16), so a
// block's integer, and every float operation after it, are the same at any number of rows:
// a token does not depend on how many rows its step verifies (the 4-bit formats' one row
// takes nibble_sums16, the same integers). The last blocks (nb % 16) go
// eight a round: two blocks a dot product, converted and scaled at once.
template <typename F, int NR>
TIDAL_INLINE void dot32(const Activations& a, int64_t r0, const Field* f,
                        const Prefetch& pf, int64_t nb, float* out) {
  using U = Unsigned32<F>;
  __m512 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i zero = _mm512_setzero_si512();
  int64_t b0 = 0;
  for (; b0 + 16 <= nb; b0 += 16) {
    const auto halves = [&](int field) {  // the 16 blocks' float16 fields as floats
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(f[field].at(b0))));
    };
    const __m512 d = halves(0);
    // each block's offset m - c d, which multiplies the sum of its x
    const __m512 off = _mm512_fnmadd_ps(_mm512_set1_ps(U::kCentre), d,
                                        F::kMin ? halves(1) : _mm512_setzero_ps());
    for (int i = 0; i < 16; ++i) pf.block(b0 + i);
    constexpr bool kAsTheyLie = NR == 1 && four_bit_nibbles<F>();  // no pairs to unpack
    __m512i pairs[8], u[8];
    if constexpr (!kAsTheyLie) {
      for (int t = 0; t < 8; ++t) pairs[t] = U::pair(f, b0 + 2 * t, true);
      if constexpr (NR > 1) transpose16(pairs, u);
    }
    for (int r = 0; r < NR; ++r) {
      const int64_t g = (r0 + r) * nb + b0;  // x's groups g .. g + 15
      __m512i sum = zero;
      if constexpr (kAsTheyLie) {
        sum = nibble_sums16(f[F::kFields - 1].at(b0), &a.q[g * kGroup]);
      } else if constexpr (NR > 1) {
        for (int i = 0; i < 8; ++i)
          sum = _mm512_dpbusd_epi32(sum, u[i], _mm512_loadu_si512(&a.qi[g * kGroup + 64 * i]));
      } else {  // x as it lies (one row is not interleaved): two blocks a product, then summed
        for (int t = 0; t < 8; ++t)
          u[t] = _mm512_dpbusd_epi32(zero, pairs[t],
                                     _mm512_loadu_si512(&a.q[(g + 2 * t) * kGroup]));
        sum = reduce16(u);
      }
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, _mm512_loadu_ps(&a.d[g])),
                               _mm512_fmadd_ps(off, _mm512_loadu_ps(&a.sum32[g]), acc[r]));
    }
  }
  alignas(64) static const int32_t kPairLanes[4][16] = {
      {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1}, {2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3},
      {4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5}, {6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7}};
  for (; b0 < nb; b0 += 8) {
    const int n = static_cast<int>(std::min<int64_t>(8, nb - b0));
    const __mmask8 valid = static_cast<__mmask8>((1u << n) - 1);
    const auto halves = [&](int field) {  // n float16 fields of blocks b0.. as floats
      return _mm256_cvtph_ps(_mm_maskz_loadu_epi16(valid, f[field].at(b0)));
    };
    const __m256 d = halves(0);
    const __m256 off = _mm256_fnmadd_ps(_mm256_set1_ps(U::kCentre), d,
                                        F::kMin ? halves(1) : _mm256_setzero_ps());
    __m512i u[4];
    for (int t = 0; 2 * t < n; ++t) {
      pf.block(b0 + 2 * t);
      pf.block(b0 + 2 * t + 1);
      u[t] = U::pair(f, b0 + 2 * t, 2 * t + 1 < n);
    }
    for (int r = 0; r < NR; ++r) {
      const int64_t g = (r0 + r) * nb + b0;  // x's groups g .. g + 7 (readable past the end)
      const __m512 dd = _mm512_zextps256_ps512(_mm256_mul_ps(d, _mm256_maskz_loadu_ps(valid, &a.d[g])));
      acc[r] = _mm512_fmadd_ps(
          _mm512_zextps256_ps512(off),
          _mm512_zextps256_ps512(_mm256_maskz_loadu_ps(valid, &a.sum32[g])), acc[r]);
      for (int t = 0; 2 * t < n; ++t) {
        const __m512i i = _mm512_dpbusd_epi32(zero, u[t], _mm512_loadu_si512(&a.q[(g + 2 * t) * kGroup]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i),
                                 _mm512_permutexvar_ps(_mm512_load_si512(kPairLanes[t]), dd), acc[r]);
      }
    }
  }
  for (int r = 0; r < NR; ++r) out[r] += _mm512_reduce_add_ps(acc[r]);
}

}  // namespace gguf
}  // namespace tidal_cpu
#endif
