// What the paged attention kernels share: float vectors of the machine's width (GCC's vector
// extension), loads that widen a KV cache row's values or codes into them, e^x that
// vectorises, and the walk over a sequence's paged context.

#pragma once

#include "kv_rows.h"

#include <limits>
#include <type_traits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace tidal_cpu {

// A vector register of floats in GCC's vector extension: AVX-512's 16 lanes (of 32
// registers) or AVX2's 8 (of 16). Arithmetic is the compiler's; only bf16's widening load
// takes intrinsics (GCC assembles a generic one from 64-bit pieces through GPRs on AVX2).
#ifdef __AVX512F__
constexpr int kLanes = 16, kRegisters = 32;
#else
constexpr int kLanes = 8, kRegisters = 16;
#endif
typedef float vf __attribute__((vector_size(4 * kLanes)));
typedef uint16_t vu16 __attribute__((vector_size(2 * kLanes)));
typedef uint32_t vu32 __attribute__((vector_size(4 * kLanes)));
typedef int8_t vi8 __attribute__((vector_size(kLanes)));
typedef int32_t vi32 __attribute__((vector_size(4 * kLanes)));
typedef uint8_t vu8 __attribute__((vector_size(kLanes)));

// e^x for softmax, on a float or on every lane of a vf, in plain arithmetic so loops over it
// vectorise (std::exp does not): Cephes' polynomial on x - n ln2 (n rounded to nearest even
// by adding and taking away 1.5 x 2^23), scaled by 2^n: a few ulp from expf over its range.
template <typename V>
inline V exp_approx(V x) {
  x = x > -87.0f ? x : V{} - 87.0f;  // NaN too
  x = x < 88.0f ? x : V{} + 88.0f;
  const V n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
  const V r = x - n * 0.693359375f + n * 2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  if constexpr (std::is_same_v<V, float>) {
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return p * scale;
  } else {
    const vi32 bits = (__builtin_convertvector(n, vi32) + 127) << 23;
    return p * reinterpret_cast<vf>(bits);
  }
}

inline vf loadv(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline vf loadv(const BFloat16* p) {  // bf16 is the top half of a float's bits
#ifdef __AVX512F__
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return reinterpret_cast<vf>(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
#elif defined(__AVX2__)
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<vf>(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#else
  vu16 h;
  std::memcpy(&h, p, sizeof h);
  return reinterpret_cast<vf>(__builtin_convertvector(h, vu32) << 16);
#endif
}

// kLanes bytes widened to 32-bit lanes, sign-extended or not. Intrinsics where the ISA has
// them: GCC's generic conversion of a byte vector goes lane by lane.
inline vu32 widen(const void* p, bool is_signed) {
#ifdef __AVX512F__
  const __m128i b = _mm_loadu_si128(static_cast<const __m128i*>(p));
  return reinterpret_cast<vu32>(is_signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
#elif defined(__AVX2__)
  const __m128i b = _mm_loadl_epi64(static_cast<const __m128i*>(p));
  return reinterpret_cast<vu32>(is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
#else
  if (is_signed) {
    vi8 b;
    std::memcpy(&b, p, sizeof b);
    return reinterpret_cast<vu32>(__builtin_convertvector(b, vi32));
  }
  vu8 b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, vu32);
#endif
}

// A quantized row's codes, unscaled.
inline vf loadv(const int8_t* p) {
  return __builtin_convertvector(reinterpret_cast<vi32>(widen(p, true)), vf);
}
// e4m3: a normal code's exponent and mantissa move into a float's, rebiased by 120; a
// subnormal one is its mantissa times 2^-9 (no denormal float on the way, which a thread
// with denormals-are-zero would read as 0).
inline vf loadv(const F8* p) {
  const vu32 u = widen(p, false);
  const vu32 normal = ((u & 0x7fu) << 20) + (120u << 23);
  const vf subnormal = __builtin_convertvector(u & 7u, vf) * 0x1p-9f;
  const vu32 bits = (u & 0x78u) == 0 ? reinterpret_cast<vu32>(subnormal) : normal;
  return reinterpret_cast<vf>(bits | ((u & 0x80u) << 24));
}

// A sequence's context in a [blocks, block_size, hkv, width] cache, for one KV head: `each`
// walks its n tokens from position `first` on (a sliding window's start; 0 otherwise) block
// by block (no division per token), calling f(index from 0, offset in the cache).
struct Paged {
  const int64_t* table;
  int64_t block_size, token_stride, head_offset, first;
  template <typename F>
  void each(int64_t n, F&& f) const {
    each_prefetched(n, static_cast<const char*>(nullptr), 0, f);
  }
  // each, and with `cache` (rows of `bytes`) fetching into L2 meanwhile the same row of the
  // block kAhead blocks on (the first kAhead blocks' rows before the walk): a block's rows
  // are too short a run for the hardware prefetchers, and a thread that waits on every row
  // reads at a third to half the speed of a stream.
  template <typename T, typename F>
  void each_prefetched(int64_t n, const T* cache, int64_t bytes, F&& f) const {
    constexpr int64_t kAhead = 2;
    const int64_t start = first / block_size, last = (first + n - 1) / block_size;
    const int64_t pitch = token_stride * sizeof(T);
    const auto rows = [&](int64_t blk) {  // block blk's rows in the cache, as bytes
      return reinterpret_cast<uintptr_t>(cache + (table[blk] * block_size * token_stride +
                                                  head_offset));
    };
    const auto fetch = [&](uintptr_t row) {  // each cache line the row touches
      for (uintptr_t line = row & ~uintptr_t{63}; line < row + bytes; line += 64)
        __builtin_prefetch(reinterpret_cast<const void*>(line), 0, 2);
    };
    if (cache)
      for (int64_t blk = start; blk < start + kAhead && blk <= last; ++blk)
        for (int64_t i = blk == start ? first % block_size : 0; i < block_size; ++i)
          fetch(rows(blk) + i * pitch);
    for (int64_t t = 0, blk = start, i0 = first % block_size; t < n; ++blk, i0 = 0) {
      const uintptr_t ahead = cache && blk + kAhead <= last ? rows(blk + kAhead) : 0;
      const int64_t base = table[blk] * block_size * token_stride + head_offset;
      const int64_t m = std::min(block_size - i0, n - t);
      for (int64_t i = i0; i < i0 + m; ++i, ++t) {
        if (ahead) fetch(ahead + i * pitch);
        f(t, base + i * token_stride);
      }
    }
  }
};

}  // namespace tidal_cpu
