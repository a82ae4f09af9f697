// Decode attention (one query per sequence, GQA) over the paged KV cache, for CPUs with AVX512-BF16.
//
// Built against torch's stable ABI (torch/csrc/stable): a few seconds to compile, no ATen headers.
// Registered as torch.ops.phaseserve_decode_attention.{decode_attention, supported}.
//
// Work items are (sequence, partition): a partition is PARTITION_TOKENS consecutive positions of one
// sequence, so how a sequence is split depends only on its own length, never on the batch or the thread
// count, and a sequence's result is bit-identical alone or batched. An item reads each 16-token tile of
// K and V once for all its KV heads (a tile of one block is contiguous in the [blocks, block_size,
// kv_heads, head_dim] layout), scores 16 tokens at a time with vdpbf16ps and a 16x16 transpose-reduce,
// and keeps an online softmax (base 2: log2(e) folded into the scale) with fp32 accumulators per query
// head. A sequence of several partitions is combined afterwards in partition order.

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/util/Exception.h>

#include <immintrin.h>

#include "attention_math.h"

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <vector>

namespace {

using torch::stable::Tensor;
using torch::headeronly::ScalarType;

constexpr int TILE = 16;
constexpr int64_t PARTITION_TOKENS = 512;  // a multiple of TILE
constexpr int PREFETCH_TILES = 2;  // software prefetch distance (1: 5-10% slower, 3-4: no better)
constexpr int MAX_GROUP = 16;  // query heads per KV head
constexpr float LOG2E = 1.4426950408889634f;

// 16 vectors -> one vector whose lane t is the sum of v[t]'s lanes.
AVX512_BF16 inline __m512 transpose_reduce(__m512 v[16]) {
  __m512 r[8], s[4], u[2];
  for (int i = 0; i < 8; i++)  // lanes per 128-bit part: (v2i, v2i+1, v2i, v2i+1)
    r[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; i++) {  // (v4i .. v4i+3) in each 128-bit part
    __m512d a = _mm512_castps_pd(r[2 * i]), b = _mm512_castps_pd(r[2 * i + 1]);
    s[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; i++)  // 128-bit parts: (s2i: 0+1, 2+3), (s2i+1: 0+1, 2+3)
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
}

AVX512_BF16 inline __m512 bf16_to_fp32(const uint16_t* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

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

// Row pointers (elements) of the tile's n tokens starting at position `tile`; rows past n repeat the first
// (their scores are masked).
inline void tile_rows(const Problem& P, const int32_t* table, int64_t tile, int n, int64_t row,
                      const uint16_t** krow, const uint16_t** vrow) {
  int64_t blk = tile / P.bs, in = tile % P.bs;
  for (int t = 0; t < n; t++) {
    const int64_t off = (static_cast<int64_t>(table[blk]) * P.bs + in) * row;
    krow[t] = P.k + off;
    vrow[t] = P.v + off;
    if (++in == P.bs) in = 0, blk++;
  }
  for (int t = n; t < TILE; t++) krow[t] = krow[0], vrow[t] = vrow[0];
}

// One partition [t0, t1) of sequence b: per query head, the running max m (base 2), the sum l of
// 2^(s - m) and the unnormalized output acc [D], written to state (acc at h * D, then m and l at the end).
// The range of positions a work item attends: sequence b's [t0, t1).
struct Span {
  int64_t b, t0, t1;
};

template <int D>
AVX512_BF16 void attend_partition(const Problem& P, int64_t b, int64_t t0, int64_t t1, float* acc,
                                  float* m, float* l, const Span* following) {
  const int64_t G = P.hq / P.hkv;
  const int64_t row = P.hkv * D;  // elements per token in a block
  const int32_t* table = P.tables + b * P.table_stride;
  for (int64_t h = 0; h < P.hq; h++) {
    m[h] = -INFINITY;
    l[h] = 0.0f;
  }
  std::memset(acc, 0, sizeof(float) * P.hq * D);
  alignas(64) uint16_t vpairs[TILE * D];  // one KV head's V tile, tokens (2i, 2i+1) interleaved per feature
  alignas(64) uint32_t ppairs[MAX_GROUP][TILE / 2];  // per query head: (p_2i, p_2i+1) as bf16 pairs
  alignas(64) float scores[MAX_GROUP][TILE];  // per query head of a KV head, base-2 scaled
  float corr[MAX_GROUP];
  const uint16_t* rows[2][2][TILE];  // [this / next tile][K / V][token]
  int cur = 0;
  tile_rows(P, table, t0, static_cast<int>(std::min<int64_t>(TILE, t1 - t0)), row, rows[0][0], rows[0][1]);
  for (int64_t tile = t0; tile < t1; tile += TILE, cur ^= 1) {
    const int n = static_cast<int>(t1 - tile < TILE ? t1 - tile : TILE);
    const uint16_t* const* krow = rows[cur][0];
    const uint16_t* const* vrow = rows[cur][1];
    const int64_t next = tile + TILE;
    const int n_next = static_cast<int>(next < t1 ? std::min<int64_t>(TILE, t1 - next) : 0);
    if (n_next > 0) tile_rows(P, table, next, n_next, row, rows[cur ^ 1][0], rows[cur ^ 1][1]);
    // blocks are scattered, so the hardware cannot guess the rows PREFETCH_TILES tiles ahead: prefetch them,
    // each KV head's share while that head computes
    const uint16_t* ahead[2][TILE];
    // near the end, the first tiles of the item this thread runs next (`following`)
    int64_t at = tile + PREFETCH_TILES * TILE, end = t1;
    const int32_t* at_table = table;
    if (at >= t1 && following != nullptr) {
      at = following->t0 + (at - t0 - (t1 - t0 + TILE - 1) / TILE * TILE);
      end = following->t1;
      at_table = P.tables + following->b * P.table_stride;
    }
    const int n_ahead = static_cast<int>(at < end ? std::min<int64_t>(TILE, end - at) : 0);
    if (n_ahead > 0) tile_rows(P, at_table, at, n_ahead, row, ahead[0], ahead[1]);
    const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
    // a whole tile inside one block is one contiguous range: prefetched in address order
    const bool contiguous = n_ahead == TILE && ahead[0][TILE - 1] == ahead[0][0] + (TILE - 1) * row &&
                            ahead[1][TILE - 1] == ahead[1][0] + (TILE - 1) * row;
    const int64_t share = (TILE * row * 2 / P.hkv + 63) / 64 * 64;  // bytes of the tile prefetched per KV head
    for (int64_t kh = 0; kh < P.hkv; kh++) {
      if (contiguous) {
        const int64_t end = std::min<int64_t>((kh + 1) * share, TILE * row * 2);
        for (int64_t byte = kh * share; byte < end; byte += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(ahead[0][0]) + byte, _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(ahead[1][0]) + byte, _MM_HINT_T0);
        }
      } else {
        for (int t = 0; t < n_ahead; t++)
          for (int64_t byte = 0; byte < D * 2; byte += 64) {
            _mm_prefetch(reinterpret_cast<const char*>(ahead[0][t] + kh * D) + byte, _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(ahead[1][t] + kh * D) + byte, _MM_HINT_T0);
          }
      }
      for (int t = 0; t < n; t += 2)
        for (int c = 0; c < D / 32; c++) {
          const __m512i x = _mm512_loadu_si512(vrow[t] + kh * D + c * 32);
          const __m512i y = t + 1 < n ? _mm512_loadu_si512(vrow[t + 1] + kh * D + c * 32) : _mm512_setzero_si512();
          _mm512_store_si512(vpairs + t * D + c * 64, _mm512_unpacklo_epi16(x, y));
          _mm512_store_si512(vpairs + t * D + c * 64 + 32, _mm512_unpackhi_epi16(x, y));
        }
      // three passes over this KV head's query heads, each free of dependencies between heads so that the
      // out-of-order core overlaps the heads' latency chains (dot, transpose, max, exp, accumulate)
      for (int64_t g = 0; g < G; g++) {
        const uint16_t* qh = P.q + b * P.q_stride + (kh * G + g) * D;
        __m512bh qv[D / 32];
        for (int c = 0; c < D / 32; c++) qv[c] = (__m512bh)_mm512_loadu_si512(qh + c * 32);
        __m512 dots[TILE];
        for (int t = 0; t < TILE; t++) {
          __m512 a = _mm512_setzero_ps();
          for (int c = 0; c < D / 32; c++)
            a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(krow[t] + kh * D + c * 32), qv[c]);
          dots[t] = a;
        }
        _mm512_store_ps(scores[g], _mm512_mul_ps(transpose_reduce(dots), _mm512_set1_ps(P.scale_log2)));
      }
      for (int64_t g = 0; g < G; g++) {
        const int64_t h = kh * G + g;
        const __m512 s = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY), _mm512_load_ps(scores[g]));
        const float m_new = std::fmax(m[h], _mm512_reduce_max_ps(s));
        const __m512 p = _mm512_maskz_mov_ps(valid, exp2_ps(_mm512_sub_ps(s, _mm512_set1_ps(m_new))));
        corr[g] = std::exp2(m[h] - m_new);  // 0 on the first tile (m = -inf)
        l[h] = l[h] * corr[g] + _mm512_reduce_add_ps(p);
        m[h] = m_new;
        _mm256_store_si256(reinterpret_cast<__m256i*>(ppairs[g]), (__m256i)_mm512_cvtneps_pbh(p));
      }
      for (int64_t g = 0; g < G; g++) {
        float* ah = acc + (kh * G + g) * D;
        __m512 o[D / 16];
        const __m512 cv = _mm512_set1_ps(corr[g]);
        for (int c = 0; c < D / 16; c++) o[c] = _mm512_mul_ps(_mm512_load_ps(ah + c * 16), cv);
        for (int t = 0; t < n; t += 2) {
          const __m512bh pt = (__m512bh)_mm512_set1_epi32(static_cast<int>(ppairs[g][t / 2]));
          for (int c = 0; c < D / 16; c++)
            o[c] = _mm512_dpbf16_ps(o[c], (__m512bh)_mm512_load_si512(vpairs + t * D + c * 32), pt);
        }
        for (int c = 0; c < D / 16; c++) _mm512_store_ps(ah + c * 16, o[c]);
      }
    }
  }
}

// Sequence b's partitions [first, last) combined in partition order (deterministic) into out [Hq, D].
template <int D>
AVX512_BF16 void combine_partitions(const float* state, int64_t per_item, int64_t hq, int64_t first, int64_t last,
                                    uint16_t* out) {
  alignas(64) float total[D];
  for (int64_t h = 0; h < hq; h++) {
    float mx = -INFINITY;
    for (int64_t i = first; i < last; i++) mx = std::fmax(mx, state[i * per_item + hq * D + h]);
    float sum = 0.0f;
    __m512 o[D / 16];
    for (int c = 0; c < D / 16; c++) o[c] = _mm512_setzero_ps();
    for (int64_t i = first; i < last; i++) {
      const float* st = state + i * per_item;
      const float w = std::exp2(st[hq * D + h] - mx);
      sum += st[hq * D + hq + h] * w;
      const __m512 wv = _mm512_set1_ps(w);
      for (int c = 0; c < D / 16; c++) o[c] = _mm512_fmadd_ps(wv, _mm512_load_ps(st + h * D + c * 16), o[c]);
    }
    for (int c = 0; c < D / 16; c++) _mm512_store_ps(total + c * 16, o[c]);
    store_normalized(out + h * D, total, 1.0f / sum, D);
  }
}

template <int D>
void run(const Problem& P, int64_t B, uint16_t* out) {
  // (sequence, partition) items; state per item: acc [Hq, D], then m [Hq] and l [Hq] padded to 64 bytes so
  // every item's accumulators stay 64-byte aligned
  std::vector<int64_t> first(B + 1, 0);
  for (int64_t b = 0; b < B; b++) {
    int64_t len = P.lens[b];
    first[b + 1] = first[b] + (len + PARTITION_TOKENS - 1) / PARTITION_TOKENS;
  }
  const int64_t items = first[B];
  const int64_t per_item = P.hq * D + (2 * P.hq + 15) / 16 * 16;
  std::vector<int64_t> item_seq(items);
  for (int64_t b = 0; b < B; b++)
    for (int64_t i = first[b]; i < first[b + 1]; i++) item_seq[i] = b;
  float* state = static_cast<float*>(std::aligned_alloc(64, sizeof(float) * per_item * items));
  STD_TORCH_CHECK(state != nullptr, "decode_attention: out of memory");

  torch::stable::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i++) {
      const int64_t b = item_seq[i];
      const int64_t t0 = (i - first[b]) * PARTITION_TOKENS;
      const int64_t t1 = std::min<int64_t>(t0 + PARTITION_TOKENS, P.lens[b]);
      float* acc = state + i * per_item;
      float* m = acc + P.hq * D;
      float* l = m + P.hq;
      Span next{0, 0, 0};
      if (i + 1 < end) {
        next.b = item_seq[i + 1];
        next.t0 = (i + 1 - first[next.b]) * PARTITION_TOKENS;
        next.t1 = std::min<int64_t>(next.t0 + PARTITION_TOKENS, P.lens[next.b]);
      }
      attend_partition<D>(P, b, t0, t1, acc, m, l, i + 1 < end ? &next : nullptr);
      if (first[b + 1] - first[b] == 1)
        for (int64_t h = 0; h < P.hq; h++) store_normalized(out + (b * P.hq + h) * D, acc + h * D, 1.0f / l[h], D);
    }
  });
  if (items > B)  // some sequence has several partitions
    torch::stable::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; b++)
        if (first[b + 1] - first[b] > 1)
          combine_partitions<D>(state, per_item, P.hq, first[b], first[b + 1], out + b * P.hq * D);
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
