// The kernels of attention_f32.cpp (the op; its comment says the numerics: one routine, attend_partition,
// whose arithmetic for a query row depends only on the row's query, its position and the sequence's K/V), in a
// header so that the fused decode layer (decode_layer_f32.cpp) runs the very same code.
#pragma once

#include <torch/csrc/stable/ops.h>
#include <torch/headeronly/util/Exception.h>

#include <immintrin.h>

#include "avx2_math.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")  // only the FMAs written out: the compiler fuses nothing on its own

namespace f32_attention {

constexpr int64_t PARTITION_TOKENS = 512;
constexpr int KEY_TILE = 32;  // keys per transposed K tile: four vectors of scores per row
constexpr int PV_TILE = 16;   // keys per p.V step (accumulators loaded and stored once a step)
constexpr int PREFETCH_KEYS = 64;  // how far ahead of the keys (and values) in use their rows are prefetched
// Register blocks (12 or 8 accumulators, enough independent FMA chains to hide their latency). How rows
// and keys are blocked never changes a row's arithmetic: each block only runs more chains side by side.
constexpr int SCORE_ROWS = 6;  // score blocks: 6 rows x 16 keys, or (few rows, as in decode) 3 rows x 32 keys
constexpr int PV_ROWS = 4;     // p.V blocks: 4 rows x 16 features, or (1-2 rows) 2 rows x 32 features
constexpr int MAX_GROUP = 16;  // query heads per KV head
constexpr int64_t MAX_ROWS = 64;  // rows attend_partition takes at once: an extend item's (position, head) rows
constexpr int ITEMS_PER_THREAD = 4;  // decode: fewer (sequence, partition) items per thread: one KV head an item
constexpr float LOG2E = 1.4426950408889634f;

// The paged cache of one sequence and one KV head: where its keys' and values' D features are.
struct SeqCache {
  const float* k;  // [blocks, bs, Hkv, D]
  const float* v;
  const int32_t* table;
  int64_t bs, token_stride, head_offset;  // token_stride = Hkv * D, head_offset = kh * D

  // rows[i] = the features of position t0 + i of `base` (k or v), i < n: one division for the lot
  void rows(const float* base, int64_t t0, int n, const float** out) const {
    int64_t blk = t0 / bs, in = t0 % bs;
    const float* row = base + (table[blk] * bs + in) * token_stride + head_offset;
    for (int i = 0; i < n; i++) {
      out[i] = row;
      if (++in == bs) {
        in = 0, blk++;
        if (i + 1 < n) row = base + table[blk] * bs * token_stride + head_offset;
      } else {
        row += token_stride;
      }
    }
  }

  // The rows of positions [t0, t0 + n) of base clipped to `end` (their count returned): the rows to prefetch
  // next (a sequence's blocks are scattered, so the hardware cannot guess them).
  int ahead(const float* base, int64_t t0, int64_t n, int64_t end, const float** out) const {
    n = std::max<int64_t>(0, std::min<int64_t>(n, end - t0));
    if (n > 0) rows(base, t0, static_cast<int>(n), out);
    return static_cast<int>(n);
  }
};

// A query row and how many keys of the partition it sees (1..PARTITION_TOKENS).
struct Row {
  const float* q;
  int64_t visible;
};

// Per-thread buffers of attend_partition for up to `rows` rows.
template <int D>
struct Scratch {
  float* scores = nullptr;  // [rows][PARTITION_TOKENS]: scores, then probabilities
  float* key_tile = nullptr;  // [D][KEY_TILE]
  int64_t rows = 0;
  ~Scratch() { std::free(scores), std::free(key_tile); }
  void reserve(int64_t n) {
    if (key_tile == nullptr) key_tile = static_cast<float*>(std::aligned_alloc(64, sizeof(float) * D * KEY_TILE));
    if (n > rows) {
      std::free(scores);
      scores = static_cast<float*>(std::aligned_alloc(64, sizeof(float) * n * PARTITION_TOKENS));
      rows = n;
    }
    STD_TORCH_CHECK(scores != nullptr && key_tile != nullptr, "attention_f32: out of memory");
  }
};

// Keys [t0, t0 + n) (n <= KEY_TILE) as out[d][key], zeros past n.
// Prefetches `ahead` (its rows and their count) a group of 8 at a time, spread over the work: a burst
// of them fills the core's miss buffers and stalls its loads.
template <int D>
AVX2_FMA void transpose_keys(const SeqCache& c, int64_t t0, int n, float* out, const float* const* ahead,
                             int n_ahead) {
  const float* keys[KEY_TILE];
  c.rows(c.k, t0, n, keys);
  for (int group = 0; group < KEY_TILE / 8; group++) {
    for (int i = group * 8; i < std::min(n_ahead, group * 8 + 8); i++)
      for (int b = 0; b < D * 4; b += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead[i]) + b, _MM_HINT_T0);
    for (int d0 = 0; d0 < D; d0 += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; i++) {
        const int t = group * 8 + i;
        r[i] = t < n ? _mm256_loadu_ps(keys[t] + d0) : _mm256_setzero_ps();
      }
      transpose8x8(r);
      for (int i = 0; i < 8; i++) _mm256_store_ps(out + (d0 + i) * KEY_TILE + group * 8, r[i]);
    }
  }
}

// scores[r][0..8 NV) = (q_r . key) * scale_log2 for NV vectors of the tile's keys from key_tile (row stride
// KEY_TILE): per score one FMA chain over d.
template <int D, int R, int NV>
AVX2_FMA inline void score_block(const float* key_tile, const Row* rows, float scale_log2, float* const* scores) {
  __m256 a[R][NV];
  for (int r = 0; r < R; r++)
    for (int v = 0; v < NV; v++) a[r][v] = _mm256_setzero_ps();
  for (int d = 0; d < D; d++) {
    __m256 k[NV];
    for (int v = 0; v < NV; v++) k[v] = _mm256_load_ps(key_tile + d * KEY_TILE + v * 8);
    for (int r = 0; r < R; r++) {
      const __m256 qd = _mm256_broadcast_ss(rows[r].q + d);
      for (int v = 0; v < NV; v++) a[r][v] = _mm256_fmadd_ps(qd, k[v], a[r][v]);
    }
  }
  const __m256 sc = _mm256_set1_ps(scale_log2);
  for (int r = 0; r < R; r++)
    for (int v = 0; v < NV; v++) _mm256_store_ps(scores[r] + v * 8, _mm256_mul_ps(a[r][v], sc));
}

// Scores of n rows for the whole tile.
template <int D>
AVX2_FMA void score_rows(int n, const float* key_tile, const Row* rows, float scale_log2, float* const* scores) {
  switch (n) {  // decode's rows (a KV head's query heads) and short remainders: all 32 keys at once
    case 1: return score_block<D, 1, 4>(key_tile, rows, scale_log2, scores);
    case 2: return score_block<D, 2, 4>(key_tile, rows, scale_log2, scores);
    case 3: return score_block<D, 3, 4>(key_tile, rows, scale_log2, scores);
    default: break;
  }
  float* right[SCORE_ROWS];
  for (int half = 0; half < 2; half++) {
    int r = 0;
    for (; r < n; r += SCORE_ROWS) {
      const int m = std::min(SCORE_ROWS, n - r);
      for (int i = 0; i < m; i++) right[i] = scores[r + i] + half * 16;
      const float* kt = key_tile + half * 16;
      switch (m) {
        case 1: score_block<D, 1, 2>(kt, rows + r, scale_log2, right); break;
        case 2: score_block<D, 2, 2>(kt, rows + r, scale_log2, right); break;
        case 3: score_block<D, 3, 2>(kt, rows + r, scale_log2, right); break;
        case 4: score_block<D, 4, 2>(kt, rows + r, scale_log2, right); break;
        case 5: score_block<D, 5, 2>(kt, rows + r, scale_log2, right); break;
        default: score_block<D, SCORE_ROWS, 2>(kt, rows + r, scale_log2, right); break;
      }
    }
  }
}

// acc[r] += sum over keys t in [0, n) of p[r][t] * values[t], each feature one FMA chain over t in order.
template <int D, int R, int PV_VECS = (R <= 2 && D >= 32 ? 4 : 2)>
AVX2_FMA inline void pv_block(const float* const* values, int n, const float* const* p, float* const* acc) {
  for (int d0 = 0; d0 < D; d0 += 8 * PV_VECS) {
    __m256 o[R][PV_VECS];
    for (int r = 0; r < R; r++)
      for (int c = 0; c < PV_VECS; c++) o[r][c] = _mm256_load_ps(acc[r] + d0 + c * 8);
    for (int t = 0; t < n; t++) {
      __m256 vv[PV_VECS];
      for (int c = 0; c < PV_VECS; c++) vv[c] = _mm256_loadu_ps(values[t] + d0 + c * 8);
      for (int r = 0; r < R; r++) {
        const __m256 pt = _mm256_broadcast_ss(p[r] + t);
        for (int c = 0; c < PV_VECS; c++) o[r][c] = _mm256_fmadd_ps(pt, vv[c], o[r][c]);
      }
    }
    for (int r = 0; r < R; r++)
      for (int c = 0; c < PV_VECS; c++) _mm256_store_ps(acc[r] + d0 + c * 8, o[r][c]);
  }
}

template <int D>
AVX2_FMA void pv_rows(int rows, const float* const* values, int n, const float* const* p, float* const* acc) {
  switch (rows) {
    case 1: return pv_block<D, 1>(values, n, p, acc);
    case 2: return pv_block<D, 2>(values, n, p, acc);
    case 3: return pv_block<D, 3>(values, n, p, acc);
    default: return pv_block<D, PV_ROWS>(values, n, p, acc);
  }
}

// Softmax of one row's scores over its `visible` keys, in place: p = 2^(s - m), 0 past visible (up to the
// next multiple of 8). Returns m, and sum(p) in *l.
AVX2_FMA inline float softmax_row(float* s, int64_t visible, float* l) {
  const int64_t vecs = (visible + 7) / 8;
  const __m256 neg_inf = _mm256_set1_ps(-INFINITY);
  __m256 mx = neg_inf;
  for (int64_t i = 0; i < vecs; i++) {
    const __m256 x = _mm256_load_ps(s + i * 8);
    mx = _mm256_max_ps(mx, _mm256_blendv_ps(neg_inf, x, _mm256_castsi256_ps(lanes_below(visible - i * 8))));
  }
  const float m = hmax8(mx);
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t i = 0; i < vecs; i++) {
    __m256 p = exp2_ps(_mm256_sub_ps(_mm256_load_ps(s + i * 8), mv));
    p = _mm256_and_ps(p, _mm256_castsi256_ps(lanes_below(visible - i * 8)));
    sum = _mm256_add_ps(sum, p);
    _mm256_store_ps(s + i * 8, p);
  }
  *l = hsum8(sum);
  return m;
}

// The rows' attention over keys [t0, t0 + visible_r) of one KV head: acc[r] [D] = sum p.V, m[r], l[r] (see
// the file's comment). Rows must come in order of non-decreasing `visible`.
template <int D>
AVX2_FMA void attend_partition(const SeqCache& c, int64_t t0, const Row* rows, int64_t n_rows, float scale_log2,
                               Scratch<D>& S, float* acc, float* m, float* l) {
  S.reserve(n_rows);
  const int64_t most = rows[n_rows - 1].visible;
  float* score_ptr[MAX_ROWS];
  // pass 1: scores, a tile of keys transposed once for all the rows that see it
  int64_t first = 0;  // rows [first, n_rows) see the tile
  for (int64_t a = 0; a < most; a += KEY_TILE) {
    while (rows[first].visible <= a) first++;
    // prefetched: K rows PREFETCH_KEYS ahead; near the end the first values, which pass 2 reads next
    const float* ahead[KEY_TILE];
    const int n_ahead = a + PREFETCH_KEYS < most ? c.ahead(c.k, t0 + a + PREFETCH_KEYS, KEY_TILE, t0 + most, ahead)
                                                 : c.ahead(c.v, t0 + a + PREFETCH_KEYS - most, KEY_TILE, t0 + most, ahead);
    transpose_keys<D>(c, t0 + a, static_cast<int>(std::min<int64_t>(KEY_TILE, most - a)), S.key_tile, ahead, n_ahead);
    for (int64_t r = first; r < n_rows; r++) score_ptr[r] = S.scores + r * PARTITION_TOKENS + a;
    score_rows<D>(static_cast<int>(n_rows - first), S.key_tile, rows + first, scale_log2, score_ptr + first);
  }
  for (int64_t r = 0; r < n_rows; r++) m[r] = softmax_row(S.scores + r * PARTITION_TOKENS, rows[r].visible, l + r);
  // pass 2: acc = p.V; a block of rows goes together up to the keys all of them see, then each on its own
  std::memset(acc, 0, sizeof(float) * D * n_rows);
  const float* values[PV_TILE];
  const float* p[PV_ROWS];
  float* out[PV_ROWS];
  first = 0;
  for (int64_t a = 0; a < most; a += PV_TILE) {
    while (rows[first].visible <= a) first++;
    const int n = static_cast<int>(std::min<int64_t>(PV_TILE, most - a));
    c.rows(c.v, t0 + a, n, values);
    const float* ahead[PV_TILE];
    const int n_ahead = c.ahead(c.v, t0 + a + PREFETCH_KEYS, PV_TILE, t0 + most, ahead);
    for (int i = 0; i < n_ahead; i++)
      for (int b = 0; b < D * 4; b += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead[i]) + b, _MM_HINT_T0);
    for (int64_t r0 = first; r0 < n_rows; r0 += PV_ROWS) {
      const int nr = static_cast<int>(std::min<int64_t>(PV_ROWS, n_rows - r0));
      for (int i = 0; i < nr; i++) p[i] = S.scores + (r0 + i) * PARTITION_TOKENS + a, out[i] = acc + (r0 + i) * D;
      const int common = static_cast<int>(std::min<int64_t>(n, rows[r0].visible - a));
      pv_rows<D>(nr, values, common, p, out);
      for (int i = 0; i < nr; i++) {
        const int own = static_cast<int>(std::min<int64_t>(n, rows[r0 + i].visible - a));
        if (own > common) {
          const float* pi = p[i] + common;
          float* oi = out[i];
          pv_block<D, 1>(values + common, own - common, &pi, &oi);
        }
      }
    }
  }
}

// Fold a partition's (acc, m, l) of one row into the row's running (o, mo, lo), partitions in order.
template <int D>
AVX2_FMA inline void fold_partition(const float* acc, float m, float l, float* o, float* mo, float* lo) {
  const float m_new = std::fmax(*mo, m);
  const float keep = std::exp2(*mo - m_new), w = std::exp2(m - m_new);  // keep = 0 on the first partition
  *lo = std::fmaf(l, w, *lo * keep);
  *mo = m_new;
  const __m256 kv = _mm256_set1_ps(keep), wv = _mm256_set1_ps(w);
  for (int d = 0; d < D; d += 8)
    _mm256_store_ps(o + d, _mm256_fmadd_ps(_mm256_load_ps(acc + d), wv, _mm256_mul_ps(_mm256_load_ps(o + d), kv)));
}

template <int D>
AVX2_FMA inline void store_output(const float* o, float l, float* out) {
  const __m256 inv = _mm256_set1_ps(1.0f / l);
  for (int d = 0; d < D; d += 8) _mm256_storeu_ps(out + d, _mm256_mul_ps(_mm256_load_ps(o + d), inv));
}

struct Problem {
  const float* q;  // [T, Hq, D], token stride q_stride
  int64_t q_stride;
  const float* k;  // [blocks, bs, Hkv, D]
  const float* v;
  const int32_t* tables;  // [B, M], row stride table_stride
  int64_t table_stride;
  const int32_t* lens;  // context after this step's queries
  int64_t hq, hkv, bs, d;
  float scale_log2;  // softmax scale * log2(e)
  float* out;  // [T, Hq, D] dense

  SeqCache cache(int64_t b, int64_t kh) const { return {k, v, tables + b * table_stride, bs, hkv * d, kh * d}; }
};

// ------------------------------------------------------------------------------------------------ decode

// A decode work item: sequence b's partition `part` (state slot `slot`) for KV heads [kh0, kh1).
struct DecodeItem {
  int64_t b, part, kh0, kh1, slot;
};

template <int D>
void run_decode(const Problem& P, int64_t B) {
  const int64_t G = P.hq / P.hkv;
  // state slots (sequence, partition): acc [Hq, D], then m [Hq], l [Hq]
  std::vector<int64_t> first(B + 1, 0);
  for (int64_t b = 0; b < B; b++) first[b + 1] = first[b] + (P.lens[b] + PARTITION_TOKENS - 1) / PARTITION_TOKENS;
  const int64_t slots = first[B];
  const int64_t per_slot = P.hq * D + 2 * P.hq + 8;  // + padding: every slot's acc 32-byte aligned
  const int64_t per_slot_aligned = (per_slot + 7) / 8 * 8;
  const int64_t threads = torch::stable::get_num_threads();
  const int64_t per_item = threads == 1 || slots >= ITEMS_PER_THREAD * threads ? P.hkv : 1;
  std::vector<DecodeItem> items;
  items.reserve(slots * (P.hkv / per_item));
  for (int64_t b = 0; b < B; b++)
    for (int64_t s = first[b]; s < first[b + 1]; s++)
      for (int64_t kh = 0; kh < P.hkv; kh += per_item) items.push_back({b, s - first[b], kh, kh + per_item, s});
  std::unique_ptr<float, decltype(&std::free)> state(
      static_cast<float*>(std::aligned_alloc(64, sizeof(float) * per_slot_aligned * std::max<int64_t>(slots, 1))),
      &std::free);
  STD_TORCH_CHECK(state != nullptr, "decode_attention: out of memory");
  std::unique_ptr<std::atomic<int64_t>[]> pending(new std::atomic<int64_t>[B]);
  for (int64_t b = 0; b < B; b++)
    pending[b].store((first[b + 1] - first[b]) * (P.hkv / per_item), std::memory_order_relaxed);
  const int64_t n_items = static_cast<int64_t>(items.size());
  torch::stable::parallel_for(0, n_items, 1, [&](int64_t begin, int64_t end) {
    thread_local Scratch<D> scratch;
    Row rows[MAX_GROUP];
    alignas(32) float o[D];
    for (int64_t i = begin; i < end; i++) {
      const DecodeItem& it = items[i];
      float* acc = state.get() + it.slot * per_slot_aligned;
      float* m = acc + P.hq * D;
      float* l = m + P.hq;
      const int64_t t0 = it.part * PARTITION_TOKENS;
      const int64_t visible = std::min<int64_t>(PARTITION_TOKENS, P.lens[it.b] - t0);
      for (int64_t kh = it.kh0; kh < it.kh1; kh++) {
        for (int64_t g = 0; g < G; g++) rows[g] = {P.q + it.b * P.q_stride + (kh * G + g) * D, visible};
        attend_partition<D>(P.cache(it.b, kh), t0, rows, G, P.scale_log2, scratch, acc + kh * G * D, m + kh * G,
                            l + kh * G);
      }
      if (pending[it.b].fetch_sub(1, std::memory_order_acq_rel) != 1) continue;
      // the sequence's last item: fold its partitions in order, per head
      for (int64_t h = 0; h < P.hq; h++) {
        float mo = -INFINITY, lo = 0.0f;
        std::memset(o, 0, sizeof(o));
        for (int64_t s = first[it.b]; s < first[it.b + 1]; s++) {
          const float* st = state.get() + s * per_slot_aligned;
          fold_partition<D>(st + h * D, st[P.hq * D + h], st[P.hq * D + P.hq + h], o, &mo, &lo);
        }
        store_output<D>(o, lo, P.out + (it.b * P.hq + h) * D);
      }
    }
  });
}

// ------------------------------------------------------------------------------------------------ extend

// An extend work item: queries [q0, q0 + n) of sequence b's chunk, for KV head kh's query heads.
struct ExtendItem {
  int64_t b, kh, q0, n;
};

template <int D>
void run_extend(const Problem& P, const int32_t* starts, int64_t B) {
  const int64_t G = P.hq / P.hkv;
  const int64_t tile = std::max<int64_t>(1, MAX_ROWS / G);  // positions an item
  std::vector<ExtendItem> items;
  for (int64_t b = 0; b < B; b++) {
    const int64_t n_new = starts[b + 1] - starts[b];
    for (int64_t kh = 0; kh < P.hkv; kh++)
      for (int64_t q0 = 0; q0 < n_new; q0 += tile) items.push_back({b, kh, q0, std::min<int64_t>(tile, n_new - q0)});
  }
  // the longest work first, so the last items threads pick up are short
  auto work = [&](const ExtendItem& it) { return P.lens[it.b] - (starts[it.b + 1] - starts[it.b]) + it.q0; };
  std::stable_sort(items.begin(), items.end(), [&](const ExtendItem& x, const ExtendItem& y) { return work(x) > work(y); });
  std::atomic<int64_t> next{0};
  const int64_t count = static_cast<int64_t>(items.size());
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(torch::stable::get_num_threads(), count));
  torch::stable::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    thread_local Scratch<D> scratch;
    const int64_t max_rows = tile * G;
    // per row: the partition's acc [D], m, l, and the running fold o [D], mo, lo
    std::unique_ptr<float, decltype(&std::free)> buf(
        static_cast<float*>(std::aligned_alloc(64, sizeof(float) * max_rows * (2 * D + 8))), &std::free);
    STD_TORCH_CHECK(buf != nullptr, "extend_attention: out of memory");
    float* acc = buf.get();
    float* o = acc + max_rows * D;
    float* m = o + max_rows * D;
    float* l = m + max_rows;
    float* mo = l + max_rows;
    float* lo = mo + max_rows;
    std::vector<Row> rows(max_rows);
    for (int64_t i = next.fetch_add(1); i < count; i = next.fetch_add(1)) {
      const ExtendItem& it = items[i];
      const int64_t start = starts[it.b], n_new = starts[it.b + 1] - start;
      const int64_t pos0 = P.lens[it.b] - n_new + it.q0;  // position of the item's first query
      const int64_t n_rows = it.n * G;
      std::memset(o, 0, sizeof(float) * n_rows * D);
      for (int64_t r = 0; r < n_rows; r++) mo[r] = -INFINITY, lo[r] = 0.0f;
      const SeqCache cache = P.cache(it.b, it.kh);
      for (int64_t t0 = 0; t0 <= pos0 + it.n - 1; t0 += PARTITION_TOKENS) {
        // the item's positions that see this partition (a suffix), each with its G heads, in position order
        const int64_t skip = std::max<int64_t>(0, t0 - pos0);
        const int64_t active = (it.n - skip) * G;
        for (int64_t j = skip; j < it.n; j++) {
          const int64_t visible = std::min<int64_t>(PARTITION_TOKENS, pos0 + j + 1 - t0);
          for (int64_t g = 0; g < G; g++)
            rows[(j - skip) * G + g] = {P.q + (start + it.q0 + j) * P.q_stride + (it.kh * G + g) * D, visible};
        }
        attend_partition<D>(cache, t0, rows.data(), active, P.scale_log2, scratch, acc, m, l);
        const int64_t base = skip * G;  // running state of row (j, g) sits at j * G + g
        for (int64_t r = 0; r < active; r++)
          fold_partition<D>(acc + r * D, m[r], l[r], o + (base + r) * D, mo + base + r, lo + base + r);
      }
      for (int64_t j = 0; j < it.n; j++)
        for (int64_t g = 0; g < G; g++)
          store_output<D>(o + (j * G + g) * D, lo[j * G + g], P.out + ((start + it.q0 + j) * P.hq + it.kh * G + g) * D);
    }
  });
}

// Every block sequence b reads must exist: checked before any read.
inline void check_blocks(const char* op, const int32_t* table, int32_t len, int64_t nb) {
  for (int64_t j = 0; j < len; j++)
    STD_TORCH_CHECK(table[j] >= 0 && table[j] < nb, op, ": block id out of range in block_tables");
}

}  // namespace f32_attention

#pragma GCC pop_options
