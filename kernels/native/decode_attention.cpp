// Decode attention (one query per sequence, GQA) over the paged KV cache, for CPUs with AVX512-BF16.
//
// Built against torch's stable ABI (torch/csrc/stable): a few seconds to compile, no ATen headers.
// Registered as torch.ops.phaseserve_decode_attention.{decode_attention, supported}.
//
// A sequence is cut into partitions of PARTITION_TOKENS consecutive positions, so how it is split depends
// only on its own length, never on the batch or the thread count. A partition is attended in two passes
// over its 16-token tiles: the first reads K and stores every query head's scores (score_tile: vdpbf16ps
// and a 16x16 transpose-reduce); then each head's softmax is taken once over the whole partition (one max,
// one exp per score, one sum), and the second pass reads V and accumulates p.V (probabilities rounded to
// bf16, fp32 accumulators). No running max and no rescale per tile: the passes are free of the serial
// max -> exp -> rescale chain, so the core overlaps heads and tiles. A sequence of several partitions is
// folded in partition order by whichever thread finishes its last one. A row's arithmetic is
// attention_math.h's, which the prefill op runs too: a position gets the same bits from either op.
//
// Work items are (sequence, partition, KV heads): all the KV heads at once (a tile of one block is one
// contiguous range in the [blocks, block_size, kv_heads, head_dim] layout) on one thread or when the batch
// gives every thread several items, else one KV head each, so that a small batch still fills the threads. A head's
// arithmetic is the same in either form: a sequence's result is bit-identical alone or batched, on any
// number of threads.

#pragma GCC optimize("fp-contract=off")  // only the FMAs written out: the same bits as the prefill op

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/util/Exception.h>

#include <immintrin.h>

#include "attention_math.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

namespace {

using torch::stable::Tensor;
using torch::headeronly::ScalarType;

constexpr int TILE = 16;
// software prefetch distance (measured: 1 is slower; 4 and 8, hints T1, T2 and NTA, or prefetching only
// each block's first lines for the hardware prefetcher to follow: no better)
constexpr int PREFETCH_TILES = 2;
constexpr int MAX_GROUP = 16;  // query heads per KV head
// fewer (sequence, partition) items than this per thread: one KV head an item
constexpr int ITEMS_PER_THREAD = 4;
constexpr float LOG2E = 1.4426950408889634f;

struct Problem {
  const uint16_t* q;  // [B, Hq, D], row stride q_stride
  int64_t q_stride;
  const uint16_t* k;  // [blocks, bs, Hkv, D]
  const uint16_t* v;
  const int32_t* tables;  // [B, M], row stride table_stride
  int64_t table_stride;
  const int32_t* lens;
  int64_t hq, hkv, bs;
  float scale_log2;  // softmax scale * log2(e)
};

// What a work item attends: sequence b's positions [t0, t1) for KV heads [kh0, kh1); its partition's
// state (acc [Hq, D], then m [Hq] and l [Hq]) is slot `slot` of the call's state.
struct Item {
  int64_t b, t0, t1, kh0, kh1, slot;
};

// Row pointers (elements) of the tile's n tokens starting at position `tile`; rows past n repeat the first
// (their scores are masked).
inline void tile_rows(const Problem& P, const int32_t* table, int64_t tile, int n, int64_t row,
                      const uint16_t* base, const uint16_t** rows) {
  int64_t blk = tile / P.bs, in = tile % P.bs;
  for (int t = 0; t < n; t++) {
    rows[t] = base + (static_cast<int64_t>(table[blk]) * P.bs + in) * row;
    if (++in == P.bs) in = 0, blk++;
  }
  for (int t = n; t < TILE; t++) rows[t] = rows[0];
}

// Software prefetch of the tiles an item reads PREFETCH_TILES ahead: its K tiles, then its V tiles, then
// the first tiles of the item this thread runs next. Blocks are scattered, so the hardware cannot guess
// them. A tile's lines are planned at the start of a tile and issued a share at a time (`issue`) while
// the tile computes, never all at once: a burst fills the core's miss buffers and stalls its loads.
template <int D>
struct Prefetcher {
  const Problem& P;
  const char* start[TILE];  // ranges to prefetch: start, bytes
  int64_t bytes[TILE];
  int ranges = 0;
  int64_t total = 0, done = 0;  // lines planned, lines issued
  int range = 0;  // where the next line to issue is: range and byte offset in it
  int64_t offset = 0;

  explicit Prefetcher(const Problem& P) : P(P) {}

  // Plan the tile at stream position `j` of `item` (j < tiles: K tile j; then V tile j - tiles), or of
  // `next` past the item's end.
  void plan(const Item& item, int64_t j, const Item* next) {
    ranges = 0, total = 0, done = 0, range = 0, offset = 0;
    int64_t tiles = (item.t1 - item.t0 + TILE - 1) / TILE;
    const Item* it = &item;
    if (j >= 2 * tiles) {
      if (next == nullptr) return;
      j -= 2 * tiles;
      it = next;
      tiles = (it->t1 - it->t0 + TILE - 1) / TILE;
      if (j >= 2 * tiles) return;
    }
    const bool is_v = j >= tiles;
    const int64_t tile = it->t0 + (is_v ? j - tiles : j) * TILE;
    const int n = static_cast<int>(std::min<int64_t>(TILE, it->t1 - tile));
    const int64_t row = P.hkv * D;
    const uint16_t* rows[TILE];
    tile_rows(P, P.tables + it->b * P.table_stride, tile, n, row, is_v ? P.v : P.k, rows);
    const int64_t seg = (it->kh1 - it->kh0) * D * 2;  // bytes of a token's row this item reads
    const int64_t head = it->kh0 * D * 2;
    if (rows[n - 1] == rows[0] + (n - 1) * row && seg == row * 2) {  // one contiguous range
      start[0] = reinterpret_cast<const char*>(rows[0]);
      bytes[0] = n * row * 2;
      ranges = 1;
    } else {
      for (int t = 0; t < n; t++) start[t] = reinterpret_cast<const char*>(rows[t]) + head, bytes[t] = seg;
      ranges = n;
    }
    for (int r = 0; r < ranges; r++) {  // whole lines: from the line holding the start
      const int64_t off = reinterpret_cast<uintptr_t>(start[r]) & 63;
      start[r] -= off;
      bytes[r] += off;
      total += (bytes[r] + 63) / 64;
    }
  }

  // Issue the planned lines up to the end of share `part` of `parts`.
  void issue(int64_t part, int64_t parts) {
    const int64_t until = (total * (part + 1) + parts - 1) / parts;
    for (; done < until; done++) {
      _mm_prefetch(start[range] + offset, _MM_HINT_T0);
      offset += 64;
      if (offset >= bytes[range]) range++, offset = 0;
    }
  }
};

// Per-thread scratch of an item: scores [heads][PARTITION_TOKENS] fp32, probabilities as bf16 pairs
// [heads][PARTITION_TOKENS / 2].
struct Scratch {
  float* scores = nullptr;
  uint32_t* probs = nullptr;
  int64_t heads = 0;
  ~Scratch() { std::free(scores), std::free(probs); }
  void reserve(int64_t h) {
    if (h <= heads) return;
    std::free(scores), std::free(probs);
    scores = static_cast<float*>(std::aligned_alloc(64, sizeof(float) * h * PARTITION_TOKENS));
    probs = static_cast<uint32_t*>(std::aligned_alloc(64, sizeof(uint32_t) * h * PARTITION_TOKENS / 2));
    STD_TORCH_CHECK(scores != nullptr && probs != nullptr, "decode_attention: out of memory");
    heads = h;
  }
};

// Query heads one p.V block serves at once (their accumulators, 16 vectors, stay in registers).
template <int D>
constexpr int PV_HEADS = 256 / D;

// acc[i] (fp32 [D] each, i < NB: consecutive query heads of one KV head) += the sum over the tile's token
// pairs t of (p_2t, p_2t+1) . (V_2t, V_2t+1): p as bf16 pairs (row stride PARTITION_TOKENS / 2), V from
// vpairs. The heads share each V load and keep NB x D/16 independent vdpbf16ps chains in flight (one head
// at a time measured slower, K/V in cache).
template <int D, int NB, int PAIRS>
AVX512_BF16 inline void pv_block(const uint16_t* vpairs, const uint32_t* p, float* acc, int pairs) {
  __m512 o[NB][D / 16];
  for (int i = 0; i < NB; i++)
    for (int c = 0; c < D / 16; c++) o[i][c] = _mm512_load_ps(acc + i * D + c * 16);
  const int np = PAIRS ? PAIRS : pairs;
  for (int t = 0; t < np; t++) {
    __m512bh vv[D / 16];
    for (int c = 0; c < D / 16; c++) vv[c] = (__m512bh)_mm512_load_si512(vpairs + t * 2 * D + c * 32);
    for (int i = 0; i < NB; i++) {
      const int32_t pt = static_cast<int32_t>(p[i * (PARTITION_TOKENS / 2) + t]);
      for (int c = 0; c < D / 16; c++) o[i][c] = dot_pair(o[i][c], pt, (__m512i)vv[c]);
    }
  }
  for (int i = 0; i < NB; i++)
    for (int c = 0; c < D / 16; c++) _mm512_store_ps(acc + i * D + c * 16, o[i][c]);
}

template <int D, int NB>
AVX512_BF16 inline void pv_block_tile(const uint16_t* vpairs, const uint32_t* p, float* acc, int pairs) {
  if (pairs == TILE / 2) pv_block<D, NB, TILE / 2>(vpairs, p, acc, pairs);  // whole tiles: fully unrolled
  else pv_block<D, NB, 0>(vpairs, p, acc, pairs);
}

template <int D>
AVX512_BF16 inline void pv_heads(int nb, const uint16_t* vpairs, const uint32_t* p, float* acc, int pairs) {
  switch (nb) {
    case 1: return pv_block_tile<D, 1>(vpairs, p, acc, pairs);
    case 2: return pv_block_tile<D, 2>(vpairs, p, acc, pairs);
    case 3: return pv_block_tile<D, (PV_HEADS<D> >= 3 ? 3 : 1)>(vpairs, p, acc, pairs);
    case 4: return pv_block_tile<D, (PV_HEADS<D> >= 4 ? 4 : 1)>(vpairs, p, acc, pairs);
    case 5: return pv_block_tile<D, (PV_HEADS<D> >= 5 ? 5 : 1)>(vpairs, p, acc, pairs);
    case 6: return pv_block_tile<D, (PV_HEADS<D> >= 6 ? 6 : 1)>(vpairs, p, acc, pairs);
    case 7: return pv_block_tile<D, (PV_HEADS<D> >= 7 ? 7 : 1)>(vpairs, p, acc, pairs);
    default: return pv_block_tile<D, (PV_HEADS<D> >= 8 ? 8 : 1)>(vpairs, p, acc, pairs);
  }
}

template <int D>
AVX512_BF16 void attend(const Problem& P, const Item& item, const Item* next, float* acc, float* m, float* l) {
  const int64_t G = P.hq / P.hkv;
  const int64_t row = P.hkv * D;  // elements per token in a block
  const int64_t b = item.b, t0 = item.t0, t1 = item.t1, kh0 = item.kh0, kh1 = item.kh1;
  const int64_t h0 = kh0 * G, heads = (kh1 - kh0) * G;
  const int32_t* table = P.tables + b * P.table_stride;
  const int64_t tiles = (t1 - t0 + TILE - 1) / TILE;
  const int last = static_cast<int>(t1 - t0 - (tiles - 1) * TILE);  // tokens in the last tile
  thread_local Scratch scratch;
  scratch.reserve(heads);
  float* const S = scratch.scores;  // [heads][PARTITION_TOKENS]
  uint32_t* const Pp = scratch.probs;  // [heads][PARTITION_TOKENS / 2]
  Prefetcher<D> pf(P);
  const uint16_t* rows[TILE];

  // pass 1: scores, K read once
  for (int64_t j = 0; j < tiles; j++) {
    const int64_t tile = t0 + j * TILE;
    const int n = j + 1 < tiles ? TILE : last;
    tile_rows(P, table, tile, n, row, P.k, rows);
    pf.plan(item, j + PREFETCH_TILES, next);
    for (int64_t kh = kh0; kh < kh1; kh++) {
      for (int64_t g = 0; g < G; g++) {
        pf.issue((kh - kh0) * G + g, heads);
        const int64_t h = kh * G + g;
        _mm512_store_ps(S + (h - h0) * PARTITION_TOKENS + j * TILE,
                        score_tile<D>(rows, kh * D, P.q + b * P.q_stride + h * D));
      }
    }
  }

  // each head's softmax over the partition (bf16 pairs for p.V)
  for (int64_t i = 0; i < heads; i++)
    m[h0 + i] = softmax_row(S + i * PARTITION_TOKENS, t1 - t0, P.scale_log2,
                            reinterpret_cast<uint16_t*>(Pp + i * (PARTITION_TOKENS / 2)), l + h0 + i);

  // pass 2: acc = p.V, V read once (each KV head's tile with tokens (2i, 2i+1) interleaved per feature)
  for (int64_t i = 0; i < heads; i++) std::memset(acc + (h0 + i) * D, 0, sizeof(float) * D);
  alignas(64) uint16_t vpairs[TILE * D];
  for (int64_t j = 0; j < tiles; j++) {
    const int64_t tile = t0 + j * TILE;
    const int n = j + 1 < tiles ? TILE : last;
    tile_rows(P, table, tile, n, row, P.v, rows);
    pf.plan(item, tiles + j + PREFETCH_TILES, next);
    for (int64_t kh = kh0; kh < kh1; kh++) {
      for (int t = 0; t < n; t += 2)
        for (int c = 0; c < D / 32; c++) {
          const __m512i x = _mm512_loadu_si512(rows[t] + kh * D + c * 32);
          const __m512i y = t + 1 < n ? _mm512_loadu_si512(rows[t + 1] + kh * D + c * 32) : _mm512_setzero_si512();
          _mm512_store_si512(vpairs + t * D + c * 64, _mm512_unpacklo_epi16(x, y));
          _mm512_store_si512(vpairs + t * D + c * 64 + 32, _mm512_unpackhi_epi16(x, y));
        }
      for (int64_t g = 0; g < G; g += PV_HEADS<D>) {
        const int64_t nb = std::min<int64_t>(PV_HEADS<D>, G - g);
        pf.issue((kh - kh0) * G + g + nb - 1, heads);
        const int64_t h = kh * G + g;
        pv_heads<D>(static_cast<int>(nb), vpairs, Pp + (h - h0) * (PARTITION_TOKENS / 2) + j * (TILE / 2),
                    acc + h * D, (n + 1) / 2);
      }
    }
  }
}

// Sequence b's partitions (state slots [first, last)) folded in partition order into out [Hq, D], for query
// heads [h0, h1).
template <int D>
AVX512_BF16 void fold_partitions(const float* state, int64_t per_slot, int64_t hq, int64_t first, int64_t last,
                                 int64_t h0, int64_t h1, uint16_t* out) {
  alignas(64) float o[D];
  for (int64_t h = h0; h < h1; h++) {
    float mo = -INFINITY, lo = 0.0f;
    std::memset(o, 0, sizeof(o));
    for (int64_t i = first; i < last; i++) {
      const float* st = state + i * per_slot;
      fold_partition(st + h * D, st[hq * D + h], st[hq * D + hq + h], o, &mo, &lo, D);
    }
    store_normalized(out + h * D, o, 1.0f / lo, D);
  }
}

template <int D>
void run(const Problem& P, int64_t B, uint16_t* out) {
  // state slots (sequence, partition): acc [Hq, D], then m [Hq] and l [Hq] padded to 64 bytes so every
  // slot's accumulators stay 64-byte aligned
  std::vector<int64_t> first(B + 1, 0);
  for (int64_t b = 0; b < B; b++)
    first[b + 1] = first[b] + (P.lens[b] + PARTITION_TOKENS - 1) / PARTITION_TOKENS;
  const int64_t slots = first[B];
  const int64_t per_slot = P.hq * D + (2 * P.hq + 15) / 16 * 16;
  // the item split over KV heads changes which thread does a head's work, never its arithmetic
  const int64_t threads = torch::stable::get_num_threads();
  const int64_t per_item = threads == 1 || slots >= ITEMS_PER_THREAD * threads ? P.hkv : 1;  // KV heads an item
  const int64_t groups = P.hkv / per_item;
  std::vector<Item> items;
  items.reserve(slots * groups);
  for (int64_t b = 0; b < B; b++)
    for (int64_t s = first[b]; s < first[b + 1]; s++) {
      const int64_t t0 = (s - first[b]) * PARTITION_TOKENS;
      const int64_t t1 = std::min<int64_t>(t0 + PARTITION_TOKENS, P.lens[b]);
      for (int64_t k = 0; k < groups; k++) items.push_back({b, t0, t1, k * per_item, (k + 1) * per_item, s});
    }
  float* state = static_cast<float*>(std::aligned_alloc(64, sizeof(float) * per_slot * slots));
  STD_TORCH_CHECK(state != nullptr, "decode_attention: out of memory");
  // per sequence of several partitions: its items still running; the thread that ends the last combines
  std::unique_ptr<std::atomic<int64_t>[]> pending;
  if (slots > B) {
    pending.reset(new std::atomic<int64_t>[B]);
    for (int64_t b = 0; b < B; b++) pending[b].store((first[b + 1] - first[b]) * groups, std::memory_order_relaxed);
  }
  const int64_t n_items = static_cast<int64_t>(items.size());
  torch::stable::parallel_for(0, n_items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i++) {
      const Item& it = items[i];
      float* acc = state + it.slot * per_slot;
      float* m = acc + P.hq * D;
      float* l = m + P.hq;
      attend<D>(P, it, i + 1 < end ? &items[i + 1] : nullptr, acc, m, l);
      const int64_t b = it.b;
      const int64_t G = P.hq / P.hkv;
      if (first[b + 1] - first[b] == 1)
        fold_partitions<D>(state, per_slot, P.hq, first[b], first[b + 1], it.kh0 * G, it.kh1 * G, out + b * P.hq * D);
      else if (pending[b].fetch_sub(1, std::memory_order_acq_rel) == 1)
        fold_partitions<D>(state, per_slot, P.hq, first[b], first[b + 1], 0, P.hq, out + b * P.hq * D);
    }
  });
  std::free(state);
}

Tensor decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens,
                        double scale) {
  STD_TORCH_CHECK(cpu_supported(), "decode_attention: this CPU lacks AVX512-BF16");
  STD_TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4 && block_tables.dim() == 2 &&
                      seq_lens.dim() == 1,
                  "decode_attention: q [B, Hq, D], caches [blocks, block_size, Hkv, D], tables [B, M], lens [B]");
  STD_TORCH_CHECK(q.scalar_type() == ScalarType::BFloat16 && k_cache.scalar_type() == ScalarType::BFloat16 &&
                      v_cache.scalar_type() == ScalarType::BFloat16,
                  "decode_attention: q and the caches must be bfloat16");
  STD_TORCH_CHECK(block_tables.scalar_type() == ScalarType::Int && seq_lens.scalar_type() == ScalarType::Int,
                  "decode_attention: block_tables and seq_lens must be int32");
  const int64_t B = q.size(0), hq = q.size(1), D = q.size(2);
  const int64_t nb = k_cache.size(0), bs = k_cache.size(1), hkv = k_cache.size(2);
  STD_TORCH_CHECK(k_cache.size(3) == D && v_cache.size(0) == nb && v_cache.size(1) == bs && v_cache.size(2) == hkv &&
                      v_cache.size(3) == D,
                  "decode_attention: cache shapes disagree with q");
  STD_TORCH_CHECK(hkv > 0 && hq % hkv == 0 && hq / hkv <= MAX_GROUP,
                  "decode_attention: query heads must be 1 to 16 times the KV heads");
  STD_TORCH_CHECK(D == 32 || D == 64 || D == 128, "decode_attention: head_dim must be 32, 64 or 128");
  STD_TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "decode_attention: caches must be contiguous");
  STD_TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == D, "decode_attention: q's heads must be dense rows");
  STD_TORCH_CHECK(block_tables.size(0) == B && seq_lens.size(0) == B && block_tables.stride(1) == 1 &&
                      seq_lens.stride(0) == 1,
                  "decode_attention: block_tables [B, M] (dense rows) and seq_lens [B]");
  STD_TORCH_CHECK(q.is_cpu() && k_cache.is_cpu() && block_tables.is_cpu() && seq_lens.is_cpu(),
                  "decode_attention: CPU tensors only");

  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  const int32_t* tables = block_tables.const_data_ptr<int32_t>();
  const int64_t M = block_tables.size(1), tstride = block_tables.stride(0);
  for (int64_t b = 0; b < B; b++) {  // every block a sequence reads must exist: checked before any read
    STD_TORCH_CHECK(lens[b] >= 1 && lens[b] <= M * bs, "decode_attention: seq_lens[", b, "] = ", lens[b],
                    " is outside [1, ", M * bs, "]");
    for (int64_t j = 0; j < (lens[b] + bs - 1) / bs; j++)
      STD_TORCH_CHECK(tables[b * tstride + j] >= 0 && tables[b * tstride + j] < nb,
                      "decode_attention: block id out of range in block_tables[", b, "]");
  }
  Tensor out = torch::stable::new_empty(q, {B, hq, D});
  if (B == 0) return out;
  Problem P{static_cast<const uint16_t*>(q.const_data_ptr()), q.stride(0),
            static_cast<const uint16_t*>(k_cache.const_data_ptr()),
            static_cast<const uint16_t*>(v_cache.const_data_ptr()), tables, tstride, lens, hq, hkv, bs,
            static_cast<float>(scale) * LOG2E};
  uint16_t* o = static_cast<uint16_t*>(out.mutable_data_ptr());
  if (D == 32) run<32>(P, B, o);
  else if (D == 64) run<64>(P, B, o);
  else run<128>(P, B, o);
  return out;
}

bool supported() { return cpu_supported(); }

}  // namespace

STABLE_TORCH_LIBRARY(phaseserve_decode_attention, m) {
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "float scale) -> Tensor");
  m.def("supported() -> bool");
}

STABLE_TORCH_LIBRARY_IMPL(phaseserve_decode_attention, CPU, m) {
  m.impl("decode_attention", TORCH_BOX(&decode_attention));
}

STABLE_TORCH_LIBRARY_IMPL(phaseserve_decode_attention, CompositeExplicitAutograd, m) {
  m.impl("supported", TORCH_BOX(&supported));
}
