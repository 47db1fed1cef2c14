// Paged decode attention: reads K and V from the paged cache in place (no gather), of the
// model's dtype or quantized rows (kv_rows.h).

#include "kv_vectors.h"

#include <array>
#include <cmath>
#include <vector>

namespace tidal_cpu {
namespace {

// softmax in place over each of `groups` rows of n scores; stats[2 j], stats[2 j + 1]: row j's
// max and sum of exponentials (what merges a context's spans). The max and the sum run a
// vector wide: a serial chain of n adds would cost more than the exponentials.
inline void softmax_rows(float* scores, int64_t groups, int64_t n, float* stats) {
  for (int64_t j = 0; j < groups; ++j) {
    float* s = scores + j * n;
    const int64_t whole = n / kLanes * kLanes;
    vf m = vf{} - std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < whole; t += kLanes) {
      const vf v = loadv(s + t);
      m = v > m ? v : m;
    }
    float mx = -std::numeric_limits<float>::infinity();
    for (int i = 0; i < kLanes; ++i) mx = std::max(mx, m[i]);
    for (int64_t t = whole; t < n; ++t) mx = std::max(mx, s[t]);
    for (int64_t t = 0; t < n; ++t) s[t] = exp_approx(s[t] - mx);
    vf sum{};
    for (int64_t t = 0; t < whole; t += kLanes) sum += loadv(s + t);
    float total = 0.f;
    for (int i = 0; i < kLanes; ++i) total += sum[i];
    for (int64_t t = whole; t < n; ++t) total += s[t];
    const float inv = 1.f / total;
    for (int64_t t = 0; t < n; ++t) s[t] *= inv;
    stats[2 * j] = mx;
    stats[2 * j + 1] = total;
  }
}

// A speculation tree row's view of its context's last positions: of the scores from index
// `from` on, only those whose bit (index - from) is set are seen. `softmax` normalises the
// seen scores packed together, exactly as a row of just those positions would (the sums run
// by lane), and gives the hidden ones weight 0, which adds nothing in the V pass: a tree
// node's output is its one-path twin's to the bit.
struct TreeMask {
  int64_t from;  // >= n: nothing hidden
  uint64_t bits;
  bool seen(int64_t t) const {
    return t < from || (t - from < 64 && (bits >> (t - from)) & 1);
  }
  // How many of n positions are seen: a one-path twin's context length.
  int64_t seen_count(int64_t n) const {
    if (from >= n) return n;
    const uint64_t valid = n - from >= 64 ? ~uint64_t{0} : (uint64_t{1} << (n - from)) - 1;
    return from + __builtin_popcountll(bits & valid);
  }
  void softmax(float* scores, int64_t groups, int64_t n, float* stats) const {
    if (from >= n) {
      softmax_rows(scores, groups, n, stats);
      return;
    }
    std::vector<int64_t> keep;
    for (int64_t t = 0; t < n; ++t)
      if (seen(t)) keep.push_back(t);
    const int64_t m = static_cast<int64_t>(keep.size());
    std::vector<float> packed(groups * m);
    for (int64_t j = 0; j < groups; ++j)
      for (int64_t i = 0; i < m; ++i) packed[j * m + i] = scores[j * n + keep[i]];
    softmax_rows(packed.data(), groups, m, stats);
    std::fill(scores, scores + groups * n, 0.f);
    for (int64_t j = 0; j < groups; ++j)
      for (int64_t i = 0; i < m; ++i) scores[j * n + keep[i]] = packed[j * m + i];
  }
};

// kLanes vectors to one whose lane i is the sum of p[i]'s lanes, in rounds that each add two
// vectors' halves side by side (kLanes - 1 adds; kLanes horizontal sums take several times
// as many). A token's sum takes the same pairs at any lane, so a score does not depend on
// where its run of kLanes tokens starts.
#define TIDAL_HALVES(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
inline vf transpose_sum(const vf* p) {
#ifdef __AVX512F__
  vf a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = TIDAL_HALVES(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21,
                        22, 23) +
           TIDAL_HALVES(p[2 * i], p[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28,
                        29, 30, 31);
  for (int i = 0; i < 4; ++i)
    b[i] = TIDAL_HALVES(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25,
                        26, 27) +
           TIDAL_HALVES(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28,
                        29, 30, 31);
  for (int i = 0; i < 2; ++i)
    c[i] = TIDAL_HALVES(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25,
                        28, 29) +
           TIDAL_HALVES(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26,
                        27, 30, 31);
  return TIDAL_HALVES(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         TIDAL_HALVES(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
  vf a[4], b[2];
  for (int i = 0; i < 4; ++i)
    a[i] = TIDAL_HALVES(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           TIDAL_HALVES(p[2 * i], p[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)
    b[i] = TIDAL_HALVES(a[2 * i], a[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           TIDAL_HALVES(a[2 * i], a[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return TIDAL_HALVES(b[0], b[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         TIDAL_HALVES(b[0], b[1], 1, 3, 5, 7, 9, 11, 13, 15);
#endif
}
#undef TIDAL_HALVES

constexpr int kMaxHeadDim = 256, kMaxGroupWidth = 4096;  // d, and groups * d, of attend_vec

// One (sequence, KV head) task for head_dim a multiple of kLanes (up to 256): each K and V
// row is loaded once as d / kLanes vectors and serves every query head of the group.
// NV = d / kLanes and G = groups when known at compile time (0: read them from d and
// groups): the loops over a row then unroll, the queries can stay in registers, and the V
// pass keeps its accumulators in registers, as many columns of V a pass as G * columns of
// them fit in three quarters of the registers (otherwise each token's update is a load and
// a store per vector). Scores go kLanes tokens at a time: each token's products as one
// vector per query head, summed across lanes together (transpose_sum). The same operations
// in the same order either way: a token's output does not depend on which instance
// computed it.
template <typename T, int NV, int G>
void attend_vec(const float* qf, const T* k_cache, const T* v_cache, const Paged& ctx, int64_t n,
                int64_t groups_, int64_t d, const TreeMask& mask, float* scores, float* stats,
                float* acc, vf* part) {
  const int64_t nv = NV > 0 ? NV : d / kLanes, groups = G > 0 ? G : groups_;
  constexpr bool kFixed = NV > 0 && G > 0;
  constexpr int kQ = kFixed ? G * NV : 1;
  vf q[kQ];
  if constexpr (kFixed)
    for (int i = 0; i < kQ; ++i) q[i] = loadv(qf + kLanes * i);
  const auto qvec = [&](int64_t j, int64_t c) {
    if constexpr (kFixed) return q[j * NV + c];
    else return loadv(qf + j * d + kLanes * c);
  };
  vf row[NV > 0 ? NV : kMaxHeadDim / kLanes];  // part: [query head][token of the kLanes]
  int64_t t0 = 0;  // the first of the kLanes tokens
  int m = 0;       // tokens of the kLanes gathered
  const auto flush = [&] {
    for (int64_t j = 0; j < groups; ++j) {
      vf* pj = part + j * kLanes;
      std::fill(pj + m, pj + kLanes, vf{});
      const vf s = transpose_sum(pj);
      std::memcpy(scores + j * n + t0, &s, sizeof(float) * m);
    }
    t0 += m;
    m = 0;
  };
  const int64_t bytes = row_width<T>(d) * sizeof(T);
  ctx.each_prefetched(n, k_cache, bytes, [&](int64_t, int64_t off) {
    const T* k = k_cache + off;
    for (int64_t c = 0; c < nv; ++c) row[c] = loadv(k + kLanes * c);
    if constexpr (kCoded<T>) {
      const float s = row_scale(k, d);
      for (int64_t c = 0; c < nv; ++c) row[c] *= s;
    }
    for (int64_t j = 0; j < groups; ++j) {
      vf sum = qvec(j, 0) * row[0];
      for (int64_t c = 1; c < nv; ++c) sum += qvec(j, c) * row[c];
      part[j * kLanes + m] = sum;
    }
    if (++m == kLanes) flush();
  });
  if (m > 0) flush();
  mask.softmax(scores, groups, n, stats);
  if constexpr (kFixed) {
    constexpr int kCols = std::max(1, std::min(NV, kRegisters * 3 / 4 / G));
    for (int c0 = 0; c0 < NV; c0 += kCols) {
      constexpr int kAcc = G * kCols;
      vf o[kAcc] = {};
      const int cols = std::min(kCols, NV - c0);
      ctx.each_prefetched(n, v_cache, bytes, [&](int64_t t, int64_t off) {
        const T* v = v_cache + off + kLanes * c0;
        for (int c = 0; c < kCols; ++c) {
          if (c >= cols) break;
          row[c] = loadv(v + kLanes * c);
        }
        const float s = row_scale(v_cache + off, d);
        for (int j = 0; j < G; ++j) {
          const float p = scores[j * n + t] * s;
          for (int c = 0; c < kCols; ++c) {
            if (c >= cols) break;
            o[j * kCols + c] += p * row[c];
          }
        }
      });
      for (int j = 0; j < G; ++j)
        for (int c = 0; c < cols; ++c)
          std::memcpy(acc + j * d + kLanes * (c0 + c), &o[j * kCols + c], sizeof(vf));
    }
  } else {
    vf out[kMaxGroupWidth / kLanes];
    std::fill(out, out + groups * nv, vf{});
    ctx.each_prefetched(n, v_cache, bytes, [&](int64_t t, int64_t off) {
      const T* v = v_cache + off;
      for (int64_t c = 0; c < nv; ++c) row[c] = loadv(v + kLanes * c);
      const float s = row_scale(v, d);
      for (int64_t j = 0; j < groups; ++j) {
        const float p = scores[j * n + t] * s;
        for (int64_t c = 0; c < nv; ++c) out[j * nv + c] += p * row[c];
      }
    });
    std::memcpy(acc, out, sizeof(float) * groups * d);
  }
}

// attend_vec with NV = d / kLanes and G fixed where a group's queries take at most 24
// vectors (AVX-512 keeps them in registers; AVX2 in L1), otherwise G read at run time.
template <typename T, int NV>
void attend_nv(const float* qf, const T* k_cache, const T* v_cache, const Paged& ctx, int64_t n,
               int64_t groups, int64_t d, const TreeMask& mask, float* scores, float* stats,
               float* acc, vf* part) {
  const auto fixed = [&]<int G>() {
    if constexpr (G * NV <= 24) {
      if (groups == G) {
        attend_vec<T, NV, G>(qf, k_cache, v_cache, ctx, n, groups, d, mask, scores, stats, acc,
                             part);
        return true;
      }
    }
    return false;
  };
  if (!(fixed.template operator()<1>() || fixed.template operator()<2>() ||
        fixed.template operator()<3>() || fixed.template operator()<4>() ||
        fixed.template operator()<5>() || fixed.template operator()<6>()))
    attend_vec<T, NV, 0>(qf, k_cache, v_cache, ctx, n, groups, d, mask, scores, stats, acc,
                         part);
}

// Any head_dim, one element at a time.
template <typename T>
void attend_scalar(const float* qf, const T* k_cache, const T* v_cache, const Paged& ctx,
                   int64_t n, int64_t groups, int64_t d, const TreeMask& mask, float* scores,
                   float* stats, float* acc) {
  ctx.each(n, [&](int64_t t, int64_t off) {
    const float s = row_scale(k_cache + off, d);
    for (int64_t j = 0; j < groups; ++j)
      scores[j * n + t] = dot(qf + j * d, k_cache + off, d) * s;
  });
  mask.softmax(scores, groups, n, stats);
  std::fill(acc, acc + groups * d, 0.f);
  ctx.each(n, [&](int64_t t, int64_t off) {
    const T* v = v_cache + off;
    const float s = row_scale(v, d);
    for (int64_t j = 0; j < groups; ++j) {
      const float p = scores[j * n + t] * s;
      for (int64_t i = 0; i < d; ++i) acc[j * d + i] += p * f32(v[i]);
    }
  });
}

// A row's context in spans, each a task, so that one long sequence spreads over every thread
// (its KV heads alone are few tasks: SmolLM2 has 3 for 2 or 64 threads). Spans end at the
// multiples of kSpan up to kTreeSpan positions before the end of what the row sees: a
// function of the row alone, so its output does not depend on its batch or on the thread
// count, and a speculation tree's row (whose hidden positions all lie in its last 64) splits
// as its one-path twin does. A row of one span is computed as it always was; the spans of a
// longer one are merged in order by their softmax maxima and sums.
constexpr int64_t kSpan = 512, kTreeSpan = 64;

struct Span {
  int64_t b, first;  // row b, its window's start
  int64_t p0, p1;    // the span: positions first + p0 .. first + p1 - 1
  TreeMask mask;     // what the span sees (from p0 on)
  int64_t part;      // its partial results' index; -1: the row's only span (writes out)
};

struct RowSpans {
  std::vector<Span> spans;
  std::vector<std::array<int64_t, 3>> merges;  // row, its first part, its spans
  int64_t parts = 0;                           // the spans of rows of more than one

  RowSpans(const int64_t* lens, const int64_t* tree, int64_t batch, int64_t window) {
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t first = window > 0 && lens[b] > window ? lens[b] - window : 0;
      const int64_t n = lens[b] - first;
      const TreeMask mask = tree ? TreeMask{tree[2 * b] - first,
                                            static_cast<uint64_t>(tree[2 * b + 1])}
                                 : TreeMask{n, 0};
      const int64_t seen = mask.seen_count(n);
      const int64_t cuts = seen > kTreeSpan ? (seen - kTreeSpan) / kSpan : 0;
      if (cuts == 0) {
        spans.push_back({b, first, 0, n, mask, -1});
        continue;
      }
      merges.push_back({b, parts, cuts + 1});
      for (int64_t c = 0; c <= cuts; ++c)  // a span before the last sees all its positions
        spans.push_back({b, first, c * kSpan, c == cuts ? n : (c + 1) * kSpan,
                         TreeMask{mask.from - c * kSpan, mask.bits}, parts++});
    }
  }
};

}  // namespace

// q: rows of [heads, d] at `q_stride` apart; caches [blocks, block_size, hkv, row width]
// of C (kv_rows.h); tables [B, W] int64; lens [B]. One task per span of a sequence's
// context (RowSpans) and KV head reads that head's positions straight from their blocks and
// serves every query head of its group.
// window > 0: only the last `window` positions of each context (a sliding-window layer).
// tree: see tidal_cpu.h.
template <typename T, typename C>
void paged_attention(const T* q, int64_t q_stride, const C* k_cache, const C* v_cache,
                     const int64_t* tables, int64_t table_width, const int64_t* lens,
                     const int64_t* tree, int64_t batch, int64_t heads, int64_t hkv, int64_t d,
                     int64_t block_size, float scale, int64_t window, T* out) {
  const int64_t groups = heads / hkv, w = row_width<C>(d);
  constexpr bool vectorisable = std::is_same_v<C, float> || std::is_same_v<C, BFloat16> ||
                                kCoded<C>;
  const bool vec = vectorisable && d % kLanes == 0 && d <= kMaxHeadDim &&
                   groups * d <= kMaxGroupWidth;
  const RowSpans plan(lens, tree, batch, window);
  // a span's partial results: [part][KV head] of each query head's output, then its stats
  const int64_t part_width = groups * (d + 2);
  static thread_local std::vector<float> kept;  // the calling thread's: a step's layers reuse it
  const size_t part_floats = plan.parts * hkv * part_width;
  if (kept.size() < part_floats) kept.resize(part_floats);
  float* parts = kept.data();
  const auto write = [&](int64_t b, int64_t g, const float* values) {  // a KV head's group
    T* row = out + (b * heads + g * groups) * d;
    for (int64_t i = 0; i < groups * d; ++i) row[i] = round_to<T>(values[i]);
  };
  const int64_t tasks = static_cast<int64_t>(plan.spans.size()) * hkv;
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> qf(groups * d), scores, acc(groups * d), stats(2 * groups);
    std::vector<vf> lanes(groups * kLanes);
    for (int64_t task = t0; task < t1; ++task) {
      const Span& sp = plan.spans[task / hkv];
      const int64_t b = sp.b, g = task % hkv, n = sp.p1 - sp.p0;
      const Paged ctx{tables + b * table_width, block_size, hkv * w, g * w, sp.first + sp.p0};
      const TreeMask& mask = sp.mask;
      scores.resize(groups * n);
      for (int64_t j = 0; j < groups; ++j)
        for (int64_t i = 0; i < d; ++i)
          qf[j * d + i] = f32(q[b * q_stride + (g * groups + j) * d + i]) * scale;
      float *qp = qf.data(), *sc = scores.data(), *st = stats.data(), *ap = acc.data();
      if constexpr (vectorisable) {
        if (vec && d == 64) {
          attend_nv<C, 64 / kLanes>(qp, k_cache, v_cache, ctx, n, groups, d, mask, sc, st, ap,
                                    lanes.data());
        } else if (vec && d == 128) {
          attend_nv<C, 128 / kLanes>(qp, k_cache, v_cache, ctx, n, groups, d, mask, sc, st, ap,
                                     lanes.data());
        } else if (vec) {
          attend_vec<C, 0, 0>(qp, k_cache, v_cache, ctx, n, groups, d, mask, sc, st, ap,
                              lanes.data());
        } else {
          attend_scalar<C>(qp, k_cache, v_cache, ctx, n, groups, d, mask, sc, st, ap);
        }
      } else {
        attend_scalar<C>(qp, k_cache, v_cache, ctx, n, groups, d, mask, sc, st, ap);
      }
      if (sp.part < 0) {
        write(b, g, ap);
      } else {
        float* part = &parts[(sp.part * hkv + g) * part_width];
        std::copy(acc.begin(), acc.end(), part);
        std::copy(stats.begin(), stats.end(), part + groups * d);
      }
    }
  });
  if (plan.merges.empty()) return;
  // each span's output (normalised over the span) weighs its share of the row's sum
  at::parallel_for(0, static_cast<int64_t>(plan.merges.size()) * hkv, 1, [&](int64_t t0,
                                                                             int64_t t1) {
    std::vector<float> weight, o(groups * d);
    for (int64_t task = t0; task < t1; ++task) {
      const auto [b, part0, count] = plan.merges[task / hkv];
      const int64_t g = task % hkv;
      const auto part = [&](int64_t s) { return &parts[((part0 + s) * hkv + g) * part_width]; };
      weight.resize(count);
      for (int64_t j = 0; j < groups; ++j) {
        float top = -std::numeric_limits<float>::infinity(), total = 0.f;
        for (int64_t s = 0; s < count; ++s) top = std::max(top, part(s)[groups * d + 2 * j]);
        for (int64_t s = 0; s < count; ++s) {
          const float* st = part(s) + groups * d + 2 * j;
          weight[s] = std::exp(st[0] - top) * st[1];
          total += weight[s];
        }
        float* oj = &o[j * d];
        std::fill(oj, oj + d, 0.f);
        for (int64_t s = 0; s < count; ++s) {  // spans in order, a head's d values at once
          const float c = weight[s] / total, *acc = part(s) + j * d;
          for (int64_t i = 0; i < d; ++i) oj[i] += c * acc[i];
        }
      }
      write(b, g, o.data());
    }
  });
}

void check_cache(const Tensor& t, at::ScalarType dtype, int64_t d) {
  const bool rows = coded(t.scalar_type());
  const bool values = t.scalar_type() == dtype || t.scalar_type() == at::kBFloat16;
  TORCH_CHECK(t.is_contiguous() && t.dim() == 4 && (rows || values) &&
                  t.size(3) == (rows ? d + kScaleBytes : d),
              "KV cache must be a contiguous [blocks, block_size, kv_heads, head_dim] tensor "
              "of the model's dtype or bfloat16, or of int8 / float8_e4m3fn rows of head_dim "
              "codes and a 2-byte scale");
}

// The kernel reads blocks by raw offset: a context longer than its table or a block id out
// of the cache would read foreign memory, so both are refused up front.
void check_tables(const Tensor& tables, const Tensor& lens, int64_t batch, int64_t num_blocks,
                  int64_t block_size) {
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == batch && lens.numel() == batch,
              "one block table and one context length per sequence");
  const int64_t* t = tables.data_ptr<int64_t>();
  const int64_t* n = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK(n[b] >= 1 && n[b] <= tables.size(1) * block_size,
                "context length ", n[b], " does not fit its block table");
  for (int64_t i = 0; i < tables.numel(); ++i)
    TORCH_CHECK(t[i] >= 0 && t[i] < num_blocks, "block id ", t[i], " is not in the cache");
}

const int64_t* tree_rows(Tensor& tree, int64_t batch) {
  if (!tree.defined()) return nullptr;
  tree = tree.to(at::kLong).contiguous();
  TORCH_CHECK(tree.dim() == 2 && tree.size(0) == batch && tree.size(1) == 2,
              "tree must be [batch, 2]: each row's (start, bits)");
  return tree.data_ptr<int64_t>();
}

// The dtypes of the decoder's models, each over caches of its dtype or quantized rows
// (decoder.cpp calls these).
#define TIDAL_PAGED(T, C)                                                                   \
  template void paged_attention<T, C>(const T*, int64_t, const C*, const C*, const int64_t*, \
                                      int64_t, const int64_t*, const int64_t*, int64_t,      \
                                      int64_t, int64_t, int64_t, int64_t, float, int64_t, T*);
TIDAL_PAGED(float, float)
TIDAL_PAGED(float, BFloat16)
TIDAL_PAGED(float, int8_t)
TIDAL_PAGED(float, F8)
TIDAL_PAGED(BFloat16, BFloat16)
TIDAL_PAGED(BFloat16, int8_t)
TIDAL_PAGED(BFloat16, F8)
#undef TIDAL_PAGED

// Paged decode attention on its own: the PyTorch path's decode attention on CPU.
Tensor paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables,
                              Tensor lens, double scale, int64_t window, Tensor tree) {
  TORCH_CHECK(q.dim() == 3, "q must be [batch, heads, head_dim]");
  check_cache(k_cache, q.scalar_type(), q.size(2));
  check_cache(v_cache, k_cache.scalar_type(), q.size(2));
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "K and V caches of one dtype");
  q = q.contiguous();
  tables = tables.to(at::kLong).contiguous();
  lens = lens.to(at::kLong).contiguous();
  const int64_t batch = q.size(0), heads = q.size(1), d = q.size(2);
  TORCH_CHECK(heads % k_cache.size(2) == 0,
              "q's heads must be a multiple of the cache's KV heads");
  check_tables(tables, lens, batch, k_cache.size(0), k_cache.size(1));
  const int64_t* rows = tree_rows(tree, batch);
  Tensor out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "paged_decode_attention", [&] {
    with_cache_type<scalar_t>(k_cache.scalar_type(), [&]<typename C>() {
      paged_attention<scalar_t, C>(q.data_ptr<scalar_t>(), heads * d, k_cache.data_ptr<C>(),
                                   v_cache.data_ptr<C>(), tables.data_ptr<int64_t>(),
                                   tables.size(1), lens.data_ptr<int64_t>(), rows, batch, heads,
                                   k_cache.size(2), d, k_cache.size(1),
                                   static_cast<float>(scale), window, out.data_ptr<scalar_t>());
    });
  });
  return out;
}

}  // namespace tidal_cpu
