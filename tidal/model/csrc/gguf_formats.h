// GGUF's block formats, each decoded one group of 32 weights at a time: weight i of a group
// is s[i / 16] * q[i] + m, q a small integer. The bit layouts follow ggml's block structs
// (ggml-common.h); the code is tidal's own.
//
// A weight row is a run of blocks (32 weights, or 256 for the K-quants) in one of two
// layouts: GGUF's own (each block's fields side by side, as the file holds them) or planar
// (each field of every block of the row in a plane of its own, the planes in the block's
// field order): the same bytes, so either may come straight from the file or a repack.
// In builds of gguf_dot8.h (kNibbleRounds) a planar nibble format's quants plane lies in
// rounds: each whole run of 8 blocks' 128 bytes as dword i of block l at 32 i + 4 l, the
// order that kernel multiplies them in (no transposition a step); the last nb % 8 blocks
// as they are. GGUFPart::rounds says which a tensor holds.

#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TIDAL_GGUF_AVX2 1
#include <immintrin.h>
#endif
// The 32-weight formats' integer kernel: gguf_dot32.h with AVX-512 VNNI, gguf_dot8.h
// (the nibble formats) with AVX2 alone.
#if defined(TIDAL_GGUF_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VNNI__)
#define TIDAL_GGUF_DOT32 1
#elif defined(TIDAL_GGUF_AVX2)
#define TIDAL_GGUF_DOT8 1
#endif

// The kernels' helpers are always inlined: a call from a kernel's loop spills every vector
// register the loop holds (and goes through the PLT), and with this many template
// instances the compiler's own inlining gives up on some.
#define TIDAL_INLINE __attribute__((always_inline)) inline

namespace tidal_cpu {
namespace gguf {

constexpr int64_t kGroup = 32;  // weights per decoded group and per activation scale
#ifdef TIDAL_GGUF_DOT8
constexpr bool kNibbleRounds = true;  // planar nibble quants in rounds (above)
#else
constexpr bool kNibbleRounds = false;
#endif

inline float fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
#ifdef TIDAL_GGUF_AVX2
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

inline uint32_t u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// One field of a row's blocks: block b's bytes start at p + b * stride, except in a nibble
// plane's rounds (blocks before rounds_end), which dword() reads.
struct Field {
  const uint8_t* p;
  int64_t stride;
  int64_t rounds_end = 0;
  const uint8_t* at(int64_t b) const { return p + b * stride; }
  // dword i (bytes 4i .. 4i + 3) of block b's 16 bytes of nibbles
  TIDAL_INLINE const uint8_t* dword(int64_t b, int i) const {
    return b < rounds_end ? p + 16 * (b & ~int64_t{7}) + 32 * i + 4 * (b & 7) : at(b) + 4 * i;
  }
};

// A decode step streams every weight from memory once, faster than the hardware prefetcher
// alone fetches it: each block asks for the bytes kAheadBytes ahead of it, a few lines at a
// time, into L2 (prefetcht2): into L1 they would hold the line-fill buffers the loads in use
// need (a 1B Q4_K_M model's projections: 34 ms a token with L2 hints, 42 with L1, 64 with
// none, on a 2-core Xeon).
constexpr int64_t kAheadBytes = 4096;
struct Prefetch {
  const uint8_t* ahead;  // the row's first byte + kAheadBytes
  int64_t block_bytes;   // the row's bytes per block, in either layout
  void block(int64_t b) const {
    for (int64_t c = 0; c < block_bytes; c += 64)
      __builtin_prefetch(ahead + b * block_bytes + c, 0, 1);
  }
};

// The fields of the row at `row` (nb blocks of format F) in either layout.
template <typename F>
TIDAL_INLINE void fields(const uint8_t* row, int64_t nb, bool planar, Field* out) {
  int64_t off = 0;
  for (int f = 0; f < F::kFields; ++f) {
    out[f] = planar ? Field{row + nb * off, F::kSize[f]} : Field{row + off, F::kBytes};
    off += F::kSize[f];
  }
  if (planar && kNibbleRounds && F::kNibbles) out[F::kFields - 1].rounds_end = nb / 8 * 8;
}

// K-quants' 6-bit scale and min of sub-block j from the block's 12 packed bytes.
inline void k_scale_min(const uint8_t* s, int64_t j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

#ifdef TIDAL_GGUF_AVX2
inline __m256i mask8(int v) { return _mm256_set1_epi8(static_cast<char>(v)); }

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// 16 bytes of nibbles -> 32 values: the low nibbles, then the high ones (Q4_0's group
// order).
TIDAL_INLINE __m256i nibbles16(__m128i raw) {
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), mask8(0x0f));
}

// Block b's 16 bytes of nibbles, in either order of the plane.
TIDAL_INLINE __m128i quants16(const Field& qs, int64_t b) {
  if (b >= qs.rounds_end) return _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs.at(b)));
  const auto at = [&](int i) { return static_cast<int>(u32(qs.dword(b, i))); };
  return _mm_setr_epi32(at(0), at(1), at(2), at(3));
}

// 32 bytes -> the 4-bit (or, with mask 3, 2-bit) field at bit `shift` of each byte.
TIDAL_INLINE __m256i bits_at(const uint8_t* p, int shift, int mask) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm256_and_si256(_mm256_srl_epi16(raw, _mm_cvtsi32_si128(shift)), mask8(mask));
}

// 16 in each byte whose bit `bit` (one set bit a byte) is set in `spread`, else 0: a Q5
// fifth bit as the value it adds.
TIDAL_INLINE __m256i fifth_bits(__m256i spread, __m256i bit) {
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), mask8(16));
}

// Q5_0/Q5_1's high bits: bit i of h -> 16 in byte i, else 0.
TIDAL_INLINE __m256i high_bits(uint32_t h) {
  const __m256i spread = _mm256_shuffle_epi8(  // byte i gets byte i / 8 of h
      _mm256_set1_epi32(static_cast<int>(h)),
      _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL));
  return fifth_bits(spread, _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL)));
}
#endif

// Each format: kBlock weights (kGroups groups) in kBytes, fields kSize (in the block's
// order). scales() sets block b's s[j][2] and m[j] for each group j; scalar() writes group j's
// q[32] and vec() returns them as bytes, so that s * q + m is the weight as gguf.quants
// computes it. kMin: m is not zero; then q is unsigned and kCenter is its midpoint, which the
// dot product takes off (q - c with m + c * s: the same weights, and int8 activation rounding
// weighs |q - c|, not q, so the error is half or less).

struct Q8_0 {  // d, qs[32]
  static constexpr int64_t kBlock = 32, kBytes = 34;
  static constexpr int kGroups = 1, kFields = 2, kCenter = 0;
  static constexpr int64_t kSize[kFields] = {2, 32};
  static constexpr bool kMin = false, kNibbles = false;
  TIDAL_INLINE static void scales(const Field* f, int64_t b, float (*s)[2], float* m) {
    s[0][0] = s[0][1] = fp16(f[0].at(b));
    m[0] = 0.f;
  }
  TIDAL_INLINE static void scalar(const Field* f, int64_t b, int, int8_t* q) {
    std::memcpy(q, f[1].at(b), 32);
  }
#ifdef TIDAL_GGUF_AVX2
  TIDAL_INLINE static __m256i vec(const Field* f, int64_t b, int) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(f[1].at(b)));
  }
#endif
};

// Q4_0, Q4_1, Q5_0, Q5_1: nibbles (weight i low, i + 16 high), Q5's fifth bits in a uint32;
// the _0 formats are centred (q - 8, q - 16), the _1 ones have a min.
template <bool kFive, bool kHasMin>
struct Q32 {
  static constexpr int64_t kBlock = 32, kBytes = 18 + 2 * kHasMin + 4 * kFive;
  static constexpr int kGroups = 1, kFields = 2 + kHasMin + kFive;  // d, (m), (qh), qs
  static constexpr int64_t kSize[4] = {2, kHasMin ? 2 : (kFive ? 4 : 16),
                                       kHasMin ? (kFive ? 4 : 16) : 16, 16};
  static constexpr bool kMin = kHasMin, kFiveBits = kFive, kNibbles = true;
  static constexpr int kCenter = kHasMin ? (kFive ? 16 : 8) : 0;
  static constexpr int kOffset = kHasMin ? 0 : (kFive ? 16 : 8);
  TIDAL_INLINE static void scales(const Field* f, int64_t b, float (*s)[2], float* m) {
    s[0][0] = s[0][1] = fp16(f[0].at(b));
    m[0] = kHasMin ? fp16(f[1].at(b)) : 0.f;
  }
  TIDAL_INLINE static void scalar(const Field* f, int64_t b, int, int8_t* q) {
    const uint32_t h = kFive ? u32(f[kFields - 2].at(b)) : 0;
    for (int i = 0; i < 16; ++i) {
      const uint8_t qs = f[kFields - 1].dword(b, i / 4)[i % 4];
      q[i] = static_cast<int8_t>((qs & 15) + (((h >> i) & 1) << 4) - kOffset);
      q[i + 16] = static_cast<int8_t>((qs >> 4) + (((h >> (i + 16)) & 1) << 4) - kOffset);
    }
  }
#ifdef TIDAL_GGUF_AVX2
  TIDAL_INLINE static __m256i vec(const Field* f, int64_t b, int) {
    __m256i q = nibbles16(quants16(f[kFields - 1], b));
    if (kFive) q = _mm256_or_si256(q, high_bits(u32(f[kFields - 2].at(b))));
    return kOffset ? _mm256_sub_epi8(q, mask8(kOffset)) : q;
  }
#endif
};
using Q4_0 = Q32<false, false>;
using Q4_1 = Q32<false, true>;
using Q5_0 = Q32<true, false>;
using Q5_1 = Q32<true, true>;

// Q4_K and Q5_K: 256 weights, 8 groups of 32 with 6-bit scales and mins times d and dmin;
// 32 bytes of nibbles hold groups 2c (low) and 2c + 1 (high); Q5_K's bit j of qh[i] is the
// fifth bit of group j's weight i.
template <bool kFive>
struct QK {
  static constexpr int64_t kBlock = 256, kBytes = 144 + 32 * kFive;
  static constexpr int kGroups = 8, kFields = 4 + kFive;  // d, dmin, scales[12], (qh), qs
  static constexpr int64_t kSize[5] = {2, 2, 12, kFive ? 32 : 128, 128};
  static constexpr bool kMin = true, kNibbles = false;
  static constexpr int kCenter = kFive ? 16 : 8;
  TIDAL_INLINE static void scales(const Field* f, int64_t b, float (*s)[2], float* m) {
    const float d = fp16(f[0].at(b)), dmin = fp16(f[1].at(b));
    const uint8_t* packed = f[2].at(b);
    for (int j = 0; j < kGroups; ++j) {
      int sc, mn;
      k_scale_min(packed, j, sc, mn);
      s[j][0] = s[j][1] = d * static_cast<float>(sc);
      m[j] = -dmin * static_cast<float>(mn);
    }
  }
  TIDAL_INLINE static void scalar(const Field* f, int64_t b, int j, int8_t* q) {
    const uint8_t* qs = f[kFields - 1].at(b) + (j / 2) * 32;
    const uint8_t* qh = kFive ? f[3].at(b) : nullptr;
    for (int i = 0; i < 32; ++i)
      q[i] = static_cast<int8_t>(((qs[i] >> (4 * (j & 1))) & 15) +
                                 (kFive ? ((qh[i] >> j) & 1) << 4 : 0));
  }
#ifdef TIDAL_GGUF_AVX2
  TIDAL_INLINE static __m256i vec(const Field* f, int64_t b, int j) {
    __m256i q = bits_at(f[kFields - 1].at(b) + (j / 2) * 32, 4 * (j & 1), 15);
    if (kFive) q = _mm256_or_si256(q, _mm256_slli_epi16(bits_at(f[3].at(b), j, 1), 4));
    return q;
  }
#endif
};
using Q4_K = QK<false>;
using Q5_K = QK<true>;

// Q6_K: 256 weights as q - 32, 6 bits: ql's nibbles and qh's 2-bit pairs, an int8 scale per
// 16 weights times d. Half h (128 weights): ql[64h + 32c + i] holds weight 128h + 32c + i
// (low nibble) and 128h + 64 + 32c + i (high); qh[32h + i] bits 2t..2t+1 weight 128h + 32t + i.
struct Q6_K {
  static constexpr int64_t kBlock = 256, kBytes = 210;
  static constexpr int kGroups = 8, kFields = 4, kCenter = 0;  // ql, qh, scales[16], d
  static constexpr int64_t kSize[kFields] = {128, 64, 16, 2};
  static constexpr bool kMin = false, kNibbles = false;
  TIDAL_INLINE static void scales(const Field* f, int64_t b, float (*s)[2], float* m) {
    const float d = fp16(f[3].at(b));
    const int8_t* sc = reinterpret_cast<const int8_t*>(f[2].at(b));
    for (int j = 0; j < kGroups; ++j) {
      s[j][0] = d * static_cast<float>(sc[2 * j]);
      s[j][1] = d * static_cast<float>(sc[2 * j + 1]);
      m[j] = 0.f;
    }
  }
  TIDAL_INLINE static void scalar(const Field* f, int64_t b, int j, int8_t* q) {
    const int h = j / 4, t = j % 4;
    const uint8_t* ql = f[0].at(b) + 64 * h + 32 * (t & 1);
    const uint8_t* qh = f[1].at(b) + 32 * h;
    for (int i = 0; i < 32; ++i)
      q[i] = static_cast<int8_t>((((ql[i] >> (4 * (t >> 1))) & 15) |
                                  (((qh[i] >> (2 * t)) & 3) << 4)) - 32);
  }
#ifdef TIDAL_GGUF_AVX2
  TIDAL_INLINE static __m256i vec(const Field* f, int64_t b, int j) {
    const int h = j / 4, t = j % 4;
    const __m256i lo = bits_at(f[0].at(b) + 64 * h + 32 * (t & 1), 4 * (t >> 1), 15);
    const __m256i hi = _mm256_slli_epi16(bits_at(f[1].at(b) + 32 * h, 2 * t, 3), 4);
    return _mm256_sub_epi8(_mm256_or_si256(lo, hi), mask8(32));
  }
#endif
};

// Calls fn.template operator()<Format>() for a ggml type id.
template <typename Fn>
void with_format(int64_t type, Fn&& fn) {
  switch (type) {
    case 2: return fn(Q4_0{});
    case 3: return fn(Q4_1{});
    case 6: return fn(Q5_0{});
    case 7: return fn(Q5_1{});
    case 8: return fn(Q8_0{});
    case 12: return fn(Q4_K{});
    case 13: return fn(Q5_K{});
    case 14: return fn(Q6_K{});
    default: TORCH_CHECK(false, "no GGUF kernel for ggml type ", type);
  }
}

}  // namespace gguf
}  // namespace tidal_cpu
