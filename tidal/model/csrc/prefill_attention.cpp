// Paged prefill attention: each sequence's new query rows attend causally (and within a
// sliding window) over their whole context, K and V read from the paged cache in place (no
// gathered copy, no mask tensor), with an online softmax (flash attention): float32
// products, or bf16 pairs (AVX512-BF16) over bf16 and quantized rows.
//
// A task is a panel of up to kTileRows query rows of one (sequence, KV head): the rows of
// its new tokens times the query heads that share the KV head, token-major. Everything a panel
// computes keeps the query rows along a vector's lanes: the queries transposed ([d][rows]),
// the scores ([keys][rows]), the output ([d][rows]). A score tile is then four keys' values
// broadcast against the rows' vectors (FMAs, no horizontal sums), the softmax's max and sum
// run lane by lane across keys, and rescaling the output is one multiply per vector.

#include "kv_vectors.h"

#include <atomic>

namespace tidal_cpu {
namespace {

constexpr int kRowVecs = kRegisters == 32 ? 6 : 3;  // 4 x kRowVecs accumulators fit
constexpr int kTileRows = kRowVecs * kLanes;        // 96 query rows (AVX-512), 24 (AVX2)
constexpr int64_t kKeys = 64;                       // keys a step of the online softmax
constexpr float kNone = -1e30f;  // a masked score: finite, so a row that sees nothing yet
                                 // rescales by e^0 instead of NaN

// One row of the cache (codes scaled) as d floats.
template <typename C>
inline void decode_row(const C* row, int64_t d, float* out) {
  const float s = row_scale(row, d);
  int64_t c = 0;
  if constexpr (std::is_same_v<C, float> || std::is_same_v<C, BFloat16> || kCoded<C>)
    for (; c + kLanes <= d; c += kLanes) {
      const vf v = loadv(row + c) * s;
      std::memcpy(out + c, &v, sizeof v);
    }
  for (; c < d; ++c) out[c] = f32(row[c]) * s;
}

// A panel's working set, one per thread. With bf16 dot products, also the queries, keys,
// values and probabilities as the bf16 pairs each product reads (queries by head dim,
// values and probabilities by key).
struct Panel {
  std::vector<float> qt, ot, keys, values, scores;  // [d][rows], [d][rows], [kKeys][d] x 2,
                                                    // [kKeys][rows]
  std::vector<uint32_t> qp, kp, vp, pp;  // [d/2][rows], [kKeys][d/2], [kKeys/2][d],
                                         // [kKeys/2][rows]
  vf m[kRowVecs], l[kRowVecs], pos[kRowVecs];  // running max, sum; each row's position
  Panel(int64_t d, bool dots)  // the pairs' buffers only where the products are bf16
      : qt(d * kTileRows), ot(d * kTileRows), keys(kKeys * d), values(kKeys * d),
        scores(kKeys * kTileRows), qp(dots ? d / 2 * kTileRows : 0),
        kp(dots ? kKeys * d / 2 : 0), vp(dots ? kKeys / 2 * d : 0),
        pp(dots ? kKeys / 2 * kTileRows : 0) {}
};

#ifdef __AVX512BF16__
constexpr bool kBf16Dots = true;

// a[i] and b[i] rounded to bf16 (to nearest even) as lane i's low and high halves: the pair
// vdpbf16ps multiplies with another lane's pair and adds to lane i.
inline __m512i pair_bf16(__m512 a, __m512 b) {
  const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(a));
  const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(b));
  return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
}

// The panel's queries, keys [0, n4) and values [0, n) as bf16 pairs (keys past n are zero;
// so is a last odd value's partner).
inline void pair_queries(Panel& p, int64_t d) {
  for (int64_t c = 0; c < d; c += 2)
    for (int v = 0; v < kRowVecs; ++v)
      _mm512_storeu_si512(p.qp.data() + c / 2 * kTileRows + v * kLanes,
                          pair_bf16(_mm512_loadu_ps(p.qt.data() + c * kTileRows + v * kLanes),
                                    _mm512_loadu_ps(p.qt.data() + (c + 1) * kTileRows +
                                                    v * kLanes)));
}

inline void pair_keys(Panel& p, int64_t n4, int64_t d) {
  auto* out = reinterpret_cast<uint16_t*>(p.kp.data());  // a key's bf16 values in order are
                                                         // its pairs along d
  for (int64_t t = 0; t < n4; ++t)
    for (int64_t c = 0; c < d; c += kLanes)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + t * d + c),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p.keys.data() + t * d + c)));
}

inline void pair_values(Panel& p, int64_t n, int64_t d) {
  for (int64_t t = 0; t < n; t += 2)
    for (int64_t c = 0; c < d; c += kLanes) {
      const __m512 a = _mm512_loadu_ps(p.values.data() + t * d + c);
      const __m512 b = t + 1 < n ? _mm512_loadu_ps(p.values.data() + (t + 1) * d + c)
                                 : _mm512_setzero_ps();
      _mm512_storeu_si512(p.vp.data() + t / 2 * d + c, pair_bf16(a, b));
    }
}

#else
constexpr bool kBf16Dots = false;
#endif

// scores[t][rows] = keys[t] . q[rows] for t < n (n rounded up to 4: keys is zero-padded), the
// first RV vectors of rows. Dots: the products as bf16 pairs along d (qp, kp), half the
// instructions.
template <int RV, bool Dots>
inline void score_tile(const Panel& p, int64_t n, int64_t d, float* scores) {
  for (int64_t t = 0; t < n; t += 4) {
    vf acc[4][RV] = {};
    if constexpr (Dots) {
#ifdef __AVX512BF16__
      const int64_t half = d / 2;
      const uint32_t* k = p.kp.data() + t * half;
      for (int64_t c = 0; c < half; ++c) {
        __m512bh q[RV];
        for (int v = 0; v < RV; ++v)
          q[v] = (__m512bh)_mm512_loadu_si512(p.qp.data() + c * kTileRows + v * kLanes);
        for (int i = 0; i < 4; ++i) {
          const __m512bh kc = (__m512bh)_mm512_set1_epi32(static_cast<int>(k[i * half + c]));
          for (int v = 0; v < RV; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], q[v], kc);
        }
      }
#endif
    } else {
      const float* k = p.keys.data() + t * d;
      for (int64_t c = 0; c < d; ++c) {
        vf q[RV];
        for (int v = 0; v < RV; ++v) q[v] = loadv(p.qt.data() + c * kTileRows + v * kLanes);
        for (int i = 0; i < 4; ++i) {
          const float kc = k[i * d + c];
          for (int v = 0; v < RV; ++v) acc[i][v] += kc * q[v];
        }
      }
    }
    for (int i = 0; i < 4; ++i)
      std::memcpy(scores + (t + i) * kTileRows, acc[i], sizeof acc[i]);
  }
}

// ot[c][rows] += sum over t < n of values[t][c] * probs[t][rows], NC columns at a time.
// Dots: the products as bf16 pairs of keys (probabilities in pp, values in vp).
template <int NC, int RV, bool Dots>
inline void value_tile(Panel& p, int64_t n, int64_t d, int64_t c0) {
  vf acc[NC][RV];
  for (int i = 0; i < NC; ++i)
    for (int v = 0; v < RV; ++v)
      acc[i][v] = loadv(p.ot.data() + (c0 + i) * kTileRows + v * kLanes);
  if constexpr (Dots) {
#ifdef __AVX512BF16__
    for (int64_t t = 0; t < (n + 1) / 2; ++t) {
      __m512bh w[RV];
      for (int v = 0; v < RV; ++v)
        w[v] = (__m512bh)_mm512_loadu_si512(p.pp.data() + t * kTileRows + v * kLanes);
      const uint32_t* val = p.vp.data() + t * d + c0;
      for (int i = 0; i < NC; ++i) {
        const __m512bh vc = (__m512bh)_mm512_set1_epi32(static_cast<int>(val[i]));
        for (int v = 0; v < RV; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], w[v], vc);
      }
    }
#endif
  } else {
    for (int64_t t = 0; t < n; ++t) {
      vf w[RV];
      for (int v = 0; v < RV; ++v) w[v] = loadv(p.scores.data() + t * kTileRows + v * kLanes);
      const float* val = p.values.data() + t * d + c0;
      for (int i = 0; i < NC; ++i)
        for (int v = 0; v < RV; ++v) acc[i][v] += val[i] * w[v];
    }
  }
  for (int i = 0; i < NC; ++i)
    std::memcpy(p.ot.data() + (c0 + i) * kTileRows, acc[i], sizeof acc[i]);
}

// Keys [k0, k0 + n) of a panel whose rows sit at positions [lo, hi]: scores, the mask where
// some row may not see some key, the online softmax's update, then the values; RV vectors
// of rows.
template <int RV, bool Dots>
inline void attend_keys(Panel& p, int64_t k0, int64_t n, int64_t d, int64_t lo, int64_t hi,
                        int64_t window) {
  float* s = p.scores.data();
  score_tile<RV, Dots>(p, (n + 3) / 4 * 4, d, s);
  const bool masked = k0 + n - 1 > lo || (window > 0 && k0 <= hi - window);
  const float span = static_cast<float>(window);
  for (int v = 0; v < RV; ++v) {
    vf mx = p.m[v];
    for (int64_t t = 0; t < n; ++t) {
      vf x = loadv(s + t * kTileRows + v * kLanes);
      if (masked) {
        const float key = static_cast<float>(k0 + t);
        const auto seen = window > 0 ? (key <= p.pos[v]) & (key > p.pos[v] - span)
                                     : key <= p.pos[v];
        x = seen ? x : vf{} + kNone;
        std::memcpy(s + t * kTileRows + v * kLanes, &x, sizeof x);
      }
      mx = x > mx ? x : mx;
    }
    const vf alpha = exp_approx(p.m[v] - mx);
    vf sum{};
    for (int64_t t = 0; t < n; ++t) {
      const vf x = loadv(s + t * kTileRows + v * kLanes);
      vf e = exp_approx(x - mx);
      e = x > kNone ? e : vf{};  // a masked key weighs exactly 0
      sum += e;
      std::memcpy(s + t * kTileRows + v * kLanes, &e, sizeof e);
    }
    p.l[v] = p.l[v] * alpha + sum;
    p.m[v] = mx;
    for (int64_t c = 0; c < d; ++c) {
      float* o = p.ot.data() + c * kTileRows + v * kLanes;
      const vf r = loadv(o) * alpha;
      std::memcpy(o, &r, sizeof r);
    }
  }
#ifdef __AVX512BF16__
  if constexpr (Dots)
    for (int64_t t = 0; t < n; t += 2)
      for (int v = 0; v < RV; ++v) {
        const float* e = s + t * kTileRows + v * kLanes;
        _mm512_storeu_si512(p.pp.data() + t / 2 * kTileRows + v * kLanes,
                            pair_bf16(_mm512_loadu_ps(e), t + 1 < n
                                      ? _mm512_loadu_ps(e + kTileRows) : _mm512_setzero_ps()));
      }
#endif
  int64_t c = 0;
  for (; c + 4 <= d; c += 4) value_tile<4, RV, Dots>(p, n, d, c);
  for (; c < d; ++c) value_tile<1, RV, Dots>(p, n, d, c);
}

struct Task {
  int64_t seq, head, first_row, rows, keys;  // keys: how many it reads (heaviest go first)
};

// attend_keys<RV> for a panel of `rows` rows: RV their vectors.
template <bool Dots, int RV = 1>
inline void attend_rows(Panel& p, int64_t rows, int64_t k0, int64_t n, int64_t d, int64_t lo,
                        int64_t hi, int64_t window) {
  if constexpr (RV < kRowVecs)
    if (rows > RV * kLanes)
      return attend_rows<Dots, RV + 1>(p, rows, k0, n, d, lo, hi, window);
  attend_keys<RV, Dots>(p, k0, n, d, lo, hi, window);
}

}  // namespace

// q, out: [tokens, heads, d]; caches [blocks, block_size, hkv, row width of C]; tables
// [seqs, width]; starts [seqs + 1] (each sequence's first new row; the last: tokens); lens
// [seqs] (context lengths, the new rows the last of them).
template <typename T, typename C>
void paged_prefill(const T* q, const C* k_cache, const C* v_cache, const int64_t* tables,
                   int64_t table_width, const int64_t* starts, const int64_t* lens, int64_t seqs,
                   int64_t heads, int64_t hkv, int64_t d, int64_t block_size, float scale,
                   int64_t window, T* out) {
  const int64_t groups = heads / hkv, w = row_width<C>(d), token_stride = hkv * w;
  // bf16 products over bf16 or quantized rows (values no finer than bf16's, or coarser
  // codes), as PyTorch's path attends over them in bf16 (attention.py); float32 rows keep
  // float32 products
  const bool dots = kBf16Dots && !std::is_same_v<C, float> && d % kLanes == 0;
  std::vector<Task> tasks;
  for (int64_t s = 0; s < seqs; ++s) {
    const int64_t rows = (starts[s + 1] - starts[s]) * groups, cached = lens[s] - rows / groups;
    // panels as even as whole vectors allow: 111 rows are 64 + 47, not 96 + 15
    const int64_t panels = (rows + kTileRows - 1) / kTileRows;
    const int64_t size = ((rows + panels - 1) / panels + kLanes - 1) / kLanes * kLanes;
    for (int64_t r0 = 0; r0 < rows; r0 += size) {
      const int64_t n_rows = std::min(size, rows - r0);
      const int64_t lo = cached + r0 / groups, hi = cached + (r0 + n_rows - 1) / groups;
      // steps of keys start at multiples of kKeys whatever the panel: a row's online softmax
      // then sums the same keys in the same steps in any panel (batch-invariant)
      const int64_t from = window > 0 ? std::max<int64_t>(0, lo - window + 1) / kKeys * kKeys
                                      : 0;
      for (int64_t g = 0; g < hkv; ++g) tasks.push_back({s, g, r0, n_rows, hi + 1 - from});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& a, const Task& b) { return a.keys > b.keys; });
  const int64_t count = static_cast<int64_t>(tasks.size());
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), count);
  std::atomic<int64_t> next{0};  // tasks taken in order as threads come free (causal rows
                                 // differ in cost: a fixed split of them would not balance)
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Panel p(d, dots);
    for (int64_t i = next++; i < count; i = next++) {
      const Task& task = tasks[i];
      const int64_t s = task.seq, g = task.head, r0 = task.first_row;
      const int64_t new_rows = starts[s + 1] - starts[s], cached = lens[s] - new_rows;
      const int64_t n_rows = task.rows;
      const int64_t lo = cached + r0 / groups, hi = cached + (r0 + n_rows - 1) / groups;
      float pos[kTileRows];
      for (int64_t r = 0; r < kTileRows; ++r) {
        const int64_t row = r0 + std::min<int64_t>(r, n_rows - 1);  // padding: the last row
        const int64_t token = starts[s] + row / groups, head = g * groups + row % groups;
        pos[r] = static_cast<float>(cached + row / groups);
        const T* qr = q + (token * heads + head) * d;
        for (int64_t c = 0; c < d; ++c) p.qt[c * kTileRows + r] = f32(qr[c]) * scale;
      }
#ifdef __AVX512BF16__
      if (dots) pair_queries(p, d);
#endif
      for (int v = 0; v < kRowVecs; ++v) {
        p.pos[v] = loadv(pos + v * kLanes);
        p.m[v] = vf{} + kNone;
        p.l[v] = vf{};
      }
      std::fill(p.ot.begin(), p.ot.end(), 0.f);
      const int64_t* table = tables + s * table_width;
      for (int64_t k0 = hi + 1 - task.keys; k0 <= hi; k0 += kKeys) {
        const int64_t n = std::min(kKeys, hi + 1 - k0);
        Paged{table, block_size, token_stride, g * w, k0}.each(n, [&](int64_t t, int64_t off) {
          decode_row(k_cache + off, d, p.keys.data() + t * d);
          decode_row(v_cache + off, d, p.values.data() + t * d);
        });
        std::fill(p.keys.begin() + n * d, p.keys.begin() + (n + 3) / 4 * 4 * d, 0.f);
#ifdef __AVX512BF16__
        if (dots) {
          pair_keys(p, (n + 3) / 4 * 4, d);
          pair_values(p, n, d);
          attend_rows<true>(p, n_rows, k0, n, d, lo, hi, window);
          continue;
        }
#endif
        attend_rows<false>(p, n_rows, k0, n, d, lo, hi, window);
      }
      float inv[kTileRows];
      for (int v = 0; v < kRowVecs; ++v) {
        const vf r = 1.f / p.l[v];
        std::memcpy(inv + v * kLanes, &r, sizeof r);
      }
      for (int64_t r = 0; r < n_rows; ++r) {
        const int64_t row = r0 + r;
        T* o = out + ((starts[s] + row / groups) * heads + g * groups + row % groups) * d;
        for (int64_t c = 0; c < d; ++c) o[c] = round_to<T>(p.ot[c * kTileRows + r] * inv[r]);
      }
    }
  });
}

bool prefill_bf16_dots() { return kBf16Dots; }

Tensor paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables,
                               Tensor starts, Tensor lens, double scale, int64_t max_query_len,
                               int64_t window) {
  TORCH_CHECK(q.dim() == 3, "q must be [tokens, heads, head_dim]");
  check_cache(k_cache, q.scalar_type(), q.size(2));
  check_cache(v_cache, k_cache.scalar_type(), q.size(2));
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "K and V caches of one dtype");
  const int64_t tokens = q.size(0), heads = q.size(1), d = q.size(2), hkv = k_cache.size(2);
  TORCH_CHECK_VALUE(heads % hkv == 0, heads, " query heads are not a multiple of the cache's ",
                    hkv, " KV heads");
  q = q.contiguous();
  tables = tables.to(at::kLong).contiguous();
  starts = starts.to(at::kLong).contiguous();
  lens = lens.to(at::kLong).contiguous();
  const int64_t seqs = lens.numel();
  TORCH_CHECK(starts.numel() == seqs + 1, "one query start per sequence, then the row count");
  check_tables(tables, lens, seqs, k_cache.size(0), k_cache.size(1));
  const int64_t* first = starts.data_ptr<int64_t>();
  const int64_t* n = lens.data_ptr<int64_t>();
  TORCH_CHECK(first[0] == 0 && first[seqs] == tokens, "query starts must run from 0 to q's rows");
  for (int64_t s = 0; s < seqs; ++s)
    TORCH_CHECK(first[s + 1] > first[s] && first[s + 1] - first[s] <= n[s],
                "a sequence's new rows must be at least one and at most its context");
  (void)max_query_len;  // the Triton kernel's grid size; the tasks here come from starts
  Tensor out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "paged_prefill_attention", [&] {
    with_cache_type<scalar_t>(k_cache.scalar_type(), [&]<typename C>() {
      paged_prefill<scalar_t, C>(q.data_ptr<scalar_t>(), k_cache.data_ptr<C>(),
                                 v_cache.data_ptr<C>(), tables.data_ptr<int64_t>(),
                                 tables.size(1), first, n, seqs, heads, hkv, d,
                                 k_cache.size(1), static_cast<float>(scale), window,
                                 out.data_ptr<scalar_t>());
    });
  });
  return out;
}

}  // namespace tidal_cpu
