// AMX's int8 tiles for the int8 panels (gguf_int8_panels.h): each unit of 16 weight rows
// (a 32-weight block; a K-quant's sub-block of 32, or Q6_K's of 16), unpacked and transposed
// into AMX's 4-byte-interleaved layout (gguf_panel.h), is one TDPBSUD (TDPBSSD for Q6_K's
// signed q - 32) against 16 activation rows: 16 x 16 integer dot products at once.

#pragma once

#include "gguf_panel.h"

#ifdef TIDAL_GGUF_DOT32
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define TIDAL_GGUF_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

namespace tidal_cpu {
namespace gguf {

// Whether this process may use the tiles: Linux hands AMX's 8 KB of tile state only to a
// process that asks (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); a refusal keeps the VNNI
// kernels.
inline bool amx_allowed() {
  static const bool allowed = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return allowed;
}

// The tiles' shapes, as LDTILECFG reads them: tile t of rows[t] rows of colsb[t] bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() = default;
  // Tiles 0-2: C (sums), A (activation rows) and B (weights), shaped for `n` activation rows
  // and units of `width` weights.
  TileConfig(int n, int width) {
    shape(0, n, 64);
    shape(1, n, width);
    shape(2, width / 4, 64);
  }
  void shape(int t, int n, int bytes) {
    rows[t] = static_cast<uint8_t>(n);
    colsb[t] = static_cast<uint16_t>(bytes);
  }
};


// A unit's 16 x nr integer dot products from AMX's tiles (tile 0: the sums, 1: nr rows of
// x, 2: the unit's weights; TileConfig(nr, width)): the tile product of the i-th unit is
// issued kAhead units before the float work that reads its sums (rows), so that the tile
// store has landed by then.
template <bool kSigned>
struct AmxProducts {
  static constexpr int kAhead = 2;
  const int8_t* x;  // the first row's q
  int64_t k;
  const Panel& p;
  int64_t nu;
  const int32_t* order;
  alignas(64) int32_t c[kAhead + 1][16][16];
  const int32_t (*sums)[16] = nullptr;

  AmxProducts(const int8_t* x_, int64_t k_, int nr, const Panel& p_, int64_t nu_,
              const int32_t* order_)
      : x(x_), k(k_), p(p_), nu(nu_), order(order_) {
    if (nr < 16) std::memset(c, 0, sizeof(c));  // the rows the tiles leave unwritten
    for (int64_t i = 0; i < std::min<int64_t>(kAhead, nu); ++i) issue(i);
  }
  void issue(int64_t i) {
    const int64_t u = order[i];
    _tile_loadd(2, &p.tiles[u * p.width * 16], 64);
    _tile_zero(0);
    _tile_loadd(1, x + u * p.width, k);
    if constexpr (kSigned) _tile_dpbssd(0, 1, 2);
    else _tile_dpbsud(0, 1, 2);
    _tile_stored(0, c[i % (kAhead + 1)], 64);
  }
  void unit(int64_t i, int64_t) {
    if (i + kAhead < nu) issue(i + kAhead);
    sums = c[i % (kAhead + 1)];
  }
  template <int NR>
  void rows(__m512i* out) const {
    for (int r = 0; r < NR; ++r) out[r] = _mm512_load_si512(sums[r]);
  }
};

}  // namespace gguf
}  // namespace tidal_cpu
#endif
#endif
