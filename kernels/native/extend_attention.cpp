// Prefill ("extend") attention over the paged KV cache, for CPUs with AVX512-BF16: a chunk of n new queries
// at positions p .. p+n-1 of a sequence attends causally to its p cached keys and the chunk's own (already
// written to the cache), GQA, head_dim 32/64/128, bf16.
//
// Built against torch's stable ABI (torch/csrc/stable), like decode_attention.cpp.
// Registered as torch.ops.phaseserve_extend_attention.{extend_attention, supported}.
//
// In two steps. First every key block (KEY_BLOCK keys at absolute positions 0, 128, 256, ...) of every KV
// head a sequence's queries read is packed once, for all its query tiles: K into pairs-of-features order
// (keys in lanes) and V into pairs-of-tokens order (the layouts vdpbf16ps reads). Then a work item, (sequence, KV head, tile of
// QUERY_TILE consecutive queries), serves all the query heads of its KV head, partition by partition
// (PARTITION_TOKENS keys at absolute positions): per query head each row's scores over the keys it sees,
// 16 at a time in the decode op's order (score_rows), each row's softmax over the partition (probabilities
// rounded to bf16, as the torch path rounds them), acc = P V with a register-blocked micro-kernel (rows of
// P broadcast as bf16 pairs x 64 features), and each row's partition folded into its output. The scores
// cost a GEMM's multiply-adds plus 15 adds per row and 16 keys (the decode order's reduction tree): what
// one numerics with the decode op, whose order is the fast one for decoding, costs prefill.
//
// One numerics with the decode op: a query row's result depends only on its own query, its position and
// the sequence's K/V, in attention_math.h's arithmetic, the decode op's too. The p.V micro-kernel only runs
// several rows' chains side by side; keys past a row's position give it probabilities 0 (adding 0 leaves
// its sums as they are), and a partition past a row's position is never folded into it. So a position gets
// the same bits here in whatever tiles or chunks its queries come, alone or batched, at any thread count,
// and from the decode op. Threads pull items from a shared counter; which thread runs an item never
// changes its arithmetic.

#pragma GCC optimize("fp-contract=off")  // only the FMAs written out: the same bits as the decode op

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
#include <vector>

namespace {

using torch::stable::Tensor;
using torch::headeronly::ScalarType;

constexpr int KEY_BLOCK = 128;   // keys per block: 8 score vectors per query row
constexpr int QUERY_TILE = 48;   // queries (positions) per work item, for all the KV head's query heads: 8 x 6 rows
constexpr int MAX_GROUP = 16;    // query heads per KV head
constexpr float LOG2E = 1.4426950408889634f;

// 16 rows of 16 dwords -> 16 columns, in place (three rounds: 32-bit, 64-bit, 128-bit interleaves).
AVX512_BF16 inline void transpose16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; i++) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; i++) {  // s[4i + k], 128-bit lane L: column 4L + k of rows 4i .. 4i+3
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int k = 0; k < 4; k++) {
    const __m512i a = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x88), b = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xDD);
    const __m512i c = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x88);
    const __m512i d = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xDD);
    t[k] = _mm512_shuffle_i32x4(a, c, 0x88);       // column k
    t[4 + k] = _mm512_shuffle_i32x4(b, d, 0x88);   // column 4 + k
    t[8 + k] = _mm512_shuffle_i32x4(a, c, 0xDD);   // column 8 + k
    t[12 + k] = _mm512_shuffle_i32x4(b, d, 0xDD);  // column 12 + k
  }
  for (int i = 0; i < 16; i++) r[i] = t[i];
}

// C[MR rows][NR * 16 lanes] (+)= sum over k pairs of A[m][2k, 2k+1] . B[k][lane][0, 1], one dot_pair chain
// per lane over k in order: A row-major bf16 (lda elements a row), B packed as pairs (ldb elements per pair
// row). With ACC, C goes on from its stored value (a chain continued from the last key block); else from 0.
// ACC is a template parameter so that each form's accumulators stay in registers from start to end.
template <int MR, int NR, bool ACC>
AVX512_BF16 inline void micro_gemm(const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, int kpairs,
                                   float* C, int64_t ldc) {
  __m512 acc[MR][NR];
#pragma GCC unroll 16
  for (int m = 0; m < MR; m++)
#pragma GCC unroll 8
    for (int n = 0; n < NR; n++) acc[m][n] = ACC ? _mm512_load_ps(C + m * ldc + n * 16) : _mm512_setzero_ps();
  for (int k = 0; k < kpairs; k++) {
    __m512bh b[NR];
#pragma GCC unroll 8
    for (int n = 0; n < NR; n++) b[n] = (__m512bh)_mm512_load_si512(B + k * ldb + n * 32);
#pragma GCC unroll 16
    for (int m = 0; m < MR; m++) {
      const int32_t pair = bf16_pair(A + m * lda + 2 * k);
#pragma GCC unroll 8
      for (int n = 0; n < NR; n++) acc[m][n] = dot_pair(acc[m][n], pair, (__m512i)b[n]);
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MR; m++)
#pragma GCC unroll 8
    for (int n = 0; n < NR; n++) _mm512_store_ps(C + m * ldc + n * 16, acc[m][n]);
}

// micro_gemm over M rows: blocks of MR_MAX rows, then the remainder.
template <int NR, int MR_MAX, bool ACC>
AVX512_BF16 inline void gemm_rows(int M, const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb,
                                  int kpairs, float* C, int64_t ldc) {
  int m = 0;
  for (; m + MR_MAX <= M; m += MR_MAX) micro_gemm<MR_MAX, NR, ACC>(A + m * lda, lda, B, ldb, kpairs, C + m * ldc, ldc);
  const int rest = M - m;
  A += m * lda;
  C += m * ldc;
  switch (rest) {  // MR_MAX <= 12
    case 1: micro_gemm<1, NR, ACC>(A, lda, B, ldb, kpairs, C, ldc); break;
    case 2: micro_gemm<2, NR, ACC>(A, lda, B, ldb, kpairs, C, ldc); break;
    case 3: micro_gemm<3, NR, ACC>(A, lda, B, ldb, kpairs, C, ldc); break;
    case 4: micro_gemm<4, NR, ACC>(A, lda, B, ldb, kpairs, C, ldc); break;
    case 5: micro_gemm<5, NR, ACC>(A, lda, B, ldb, kpairs, C, ldc); break;
    case 6: micro_gemm<6, NR, ACC>(A, lda, B, ldb, kpairs, C, ldc); break;
    case 7: micro_gemm<7, NR, ACC>(A, lda, B, ldb, kpairs, C, ldc); break;
    case 8: micro_gemm<8, NR, ACC>(A, lda, B, ldb, kpairs, C, ldc); break;
    case 9: micro_gemm<9, NR, ACC>(A, lda, B, ldb, kpairs, C, ldc); break;
    case 10: micro_gemm<10, NR, ACC>(A, lda, B, ldb, kpairs, C, ldc); break;
    case 11: micro_gemm<11, NR, ACC>(A, lda, B, ldb, kpairs, C, ldc); break;
    default: break;
  }
}

struct Problem {
  const uint16_t* q;  // [T, Hq, D], token stride q_stride
  int64_t q_stride;
  const uint16_t* k;  // [blocks, bs, Hkv, D]
  const uint16_t* v;
  const int32_t* tables;  // [B, M], row stride table_stride
  int64_t table_stride;
  const int32_t* lens;  // context after the chunk
  const int32_t* starts;  // query_start_loc [B + 1]
  int64_t hq, hkv, bs;
  float scale_log2;  // softmax scale * log2(e)
  uint16_t* out;  // [T, Hq, D] dense
};

struct Item {
  int64_t b, kh, q0, rows;  // sequence, KV head, first query (index within the chunk), queries
};

// One key block of one KV head, packed for vdpbf16ps: K by feature pairs (keys in lanes), V by token pairs.
template <int D>
struct PackedBlock {
  alignas(64) uint16_t k[D / 2][KEY_BLOCK * 2];  // [feature pair][key][2]
  alignas(64) uint16_t v[KEY_BLOCK / 2][D * 2];  // [token pair][feature, in unpacklo/unpackhi order][2]
};

// A work item's buffers, one set per thread: one query head's partition (scores, probabilities, p.V, max and
// sum per row), and every query head's running output.
template <int D>
struct Scratch {
  alignas(64) float scores[QUERY_TILE][PARTITION_TOKENS];
  alignas(64) uint16_t probs[QUERY_TILE][PARTITION_TOKENS];
  alignas(64) float acc[QUERY_TILE][D];
  float m[QUERY_TILE], l[QUERY_TILE];
  alignas(64) float o[MAX_GROUP][QUERY_TILE][D];
  float mo[MAX_GROUP][QUERY_TILE], lo[MAX_GROUP][QUERY_TILE];
};

// Raw scores of MR query rows (q, rows q_stride apart) against 16 keys of a packed block (kt: their first
// feature pair's vector, pair rows ldk apart) into out (rows ldo apart), in the decode op's order
// (score_tile in attention_math.h) with the keys in lanes: per key, partial i (i < 16) is one vdpbf16ps
// chain over pairs i, i + 16, ... (score_tile's lane i), and the 16 partials are summed in
// transpose_reduce's tree, ((x0 + x2) + (x1 + x3)) per four, then pairs of those, then the two halves,
// here as vertical adds: the decode op's bits without its shuffles.
template <int D, int MR>
AVX512_BF16 inline void score_rows(const uint16_t* kt, int64_t ldk, const uint16_t* q, int64_t q_stride, float* out,
                                   int64_t ldo) {
  __m512 half[MR], quarter[MR];  // the tree's sums of partials 0-7 and 8-11 as they complete
  for (int p = 0; p < 4; p++) {  // partials 4p .. 4p+3
    __m512 x[MR][4];
    for (int r = 0; r < MR; r++)
      for (int j = 0; j < 4; j++) x[r][j] = _mm512_setzero_ps();
    for (int c = 0; c < D / 32; c++) {
      __m512i kv[4];
      for (int j = 0; j < 4; j++) kv[j] = _mm512_load_si512(kt + (16 * c + 4 * p + j) * ldk);
      for (int r = 0; r < MR; r++)
        for (int j = 0; j < 4; j++)
          x[r][j] = dot_pair(x[r][j], bf16_pair(q + r * q_stride + 2 * (16 * c + 4 * p + j)), kv[j]);
    }
    for (int r = 0; r < MR; r++) {
      const __m512 four = _mm512_add_ps(_mm512_add_ps(x[r][0], x[r][2]), _mm512_add_ps(x[r][1], x[r][3]));
      if (p == 0 || p == 2) quarter[r] = four;
      else if (p == 1) half[r] = _mm512_add_ps(quarter[r], four);
      else _mm512_store_ps(out + r * ldo, _mm512_add_ps(half[r], _mm512_add_ps(quarter[r], four)));
    }
  }
}

template <int D>
AVX512_BF16 inline void score_row_block(int m, const uint16_t* kt, int64_t ldk, const uint16_t* q, int64_t q_stride,
                                        float* out, int64_t ldo) {
  switch (m) {
    case 1: return score_rows<D, 1>(kt, ldk, q, q_stride, out, ldo);
    case 2: return score_rows<D, 2>(kt, ldk, q, q_stride, out, ldo);
    case 3: return score_rows<D, 3>(kt, ldk, q, q_stride, out, ldo);
    default: return score_rows<D, 4>(kt, ldk, q, q_stride, out, ldo);
  }
}

// Pack keys [k0, k0 + n) of KV head kh of the sequence with this block table; zeros past n.
template <int D>
AVX512_BF16 void pack_block(const Problem& P, const int32_t* table, int64_t kh, int64_t k0, int n,
                            PackedBlock<D>& S) {
  const int64_t row = P.hkv * D;
  const uint16_t* krow[KEY_BLOCK];
  const uint16_t* vrow[KEY_BLOCK];
  int64_t blk = k0 / P.bs, in = k0 % P.bs;
  for (int t = 0; t < n; t++) {
    const int64_t off = (static_cast<int64_t>(table[blk]) * P.bs + in) * row + kh * D;
    krow[t] = P.k + off;
    vrow[t] = P.v + off;
    if (++in == P.bs) in = 0, blk++;
  }
  const int tiles = (n + 15) / 16;
  for (int tile = 0; tile < tiles; tile++)
    for (int c = 0; c < D / 32; c++) {  // 16 keys x 32 features (16 pairs) -> 16 pair vectors of 16 keys
      __m512i r[16];
      for (int t = 0; t < 16; t++) {
        const int key = tile * 16 + t;
        r[t] = key < n ? _mm512_loadu_si512(krow[key] + c * 32) : _mm512_setzero_si512();
      }
      transpose16x16(r);
      for (int j = 0; j < 16; j++) _mm512_store_si512(&S.k[c * 16 + j][tile * 32], r[j]);
    }
  for (int t = 0; t < n; t += 2)
    for (int c = 0; c < D / 32; c++) {
      const __m512i x = _mm512_loadu_si512(vrow[t] + c * 32);
      const __m512i y = t + 1 < n ? _mm512_loadu_si512(vrow[t + 1] + c * 32) : _mm512_setzero_si512();
      _mm512_store_si512(&S.v[t / 2][c * 64], _mm512_unpacklo_epi16(x, y));
      _mm512_store_si512(&S.v[t / 2][c * 64 + 32], _mm512_unpackhi_epi16(x, y));
    }
}

// Tile `it` over its sequence's packed blocks (blocks[j] = key block j of the item's KV head).
template <int D>
AVX512_BF16 void attend_item(const Problem& P, const Item& it, const PackedBlock<D>* const* blocks, Scratch<D>& S) {
  const int64_t G = P.hq / P.hkv;
  const int64_t start = P.starts[it.b], n_new = P.starts[it.b + 1] - start;
  const int64_t pos0 = P.lens[it.b] - n_new + it.q0;  // position of the tile's first query
  const int rows = static_cast<int>(it.rows);
  const int64_t last = pos0 + rows - 1;
  const uint16_t* q0 = P.q + (start + it.q0) * P.q_stride;
  for (int64_t g = 0; g < G; g++) {
    std::memset(S.o[g], 0, sizeof(float) * rows * D);
    for (int r = 0; r < rows; r++) S.mo[g][r] = -INFINITY, S.lo[g][r] = 0.0f;
  }
  constexpr int PV_NR = D / 16 < 4 ? D / 16 : 4;  // accumulator vectors per row in acc = P V
  for (int64_t t0 = 0; t0 <= last; t0 += PARTITION_TOKENS) {
    const int64_t extent = std::min<int64_t>(PARTITION_TOKENS, last + 1 - t0);  // keys the tile's last row sees
    const int first = static_cast<int>(std::max<int64_t>(0, t0 - pos0));  // rows [first, rows) see the partition
    const int nr = rows - first;
    const int64_t padded = (extent + 15) / 16 * 16;  // probabilities p.V reads (0 past each row's keys)
    for (int64_t g = 0; g < G; g++) {
      const int64_t h = it.kh * G + g;
      // scores: the rows that see a 16-key tile, 4 at a time
      for (int64_t k0 = 0; k0 < extent; k0 += 16) {
        const PackedBlock<D>& pb = *blocks[(t0 + k0) / KEY_BLOCK];
        const uint16_t* kt = &pb.k[0][0] + 2 * (k0 % KEY_BLOCK);
        // rows [first + skip, rows) see this tile (positions rise along the tile)
        const int skip = static_cast<int>(std::max<int64_t>(0, t0 + k0 - pos0 - first));
        for (int i = skip; i < nr; i += 4)
          score_row_block<D>(std::min(4, nr - i), kt, KEY_BLOCK * 2, q0 + (first + i) * P.q_stride + h * D,
                             P.q_stride, S.scores[i] + k0, PARTITION_TOKENS);
      }
      for (int i = 0; i < nr; i++) {
        const int64_t visible = std::min<int64_t>(PARTITION_TOKENS, pos0 + first + i + 1 - t0);
        S.m[i] = softmax_row(S.scores[i], visible, P.scale_log2, S.probs[i], S.l + i);
        const int64_t written = (visible + 15) / 16 * 16;
        std::memset(S.probs[i] + written, 0, sizeof(uint16_t) * (padded - written));
      }
      for (int64_t k0 = 0; k0 < extent; k0 += KEY_BLOCK) {
        const PackedBlock<D>& pb = *blocks[(t0 + k0) / KEY_BLOCK];
        const int kpairs = static_cast<int>((std::min<int64_t>(KEY_BLOCK, extent - k0) + 1) / 2);
        for (int d0 = 0; d0 < D; d0 += PV_NR * 16) {
          if (k0 == 0)
            gemm_rows<PV_NR, 24 / PV_NR, false>(nr, &S.probs[0][0], PARTITION_TOKENS, &pb.v[0][0] + 2 * d0, D * 2,
                                                kpairs, &S.acc[0][0] + d0, D);
          else
            gemm_rows<PV_NR, 24 / PV_NR, true>(nr, &S.probs[0][0] + k0, PARTITION_TOKENS, &pb.v[0][0] + 2 * d0,
                                               D * 2, kpairs, &S.acc[0][0] + d0, D);
        }
      }
      for (int i = 0; i < nr; i++)
        fold_partition(S.acc[i], S.m[i], S.l[i], S.o[g][first + i], &S.mo[g][first + i], &S.lo[g][first + i], D);
    }
  }
  for (int r = 0; r < rows; r++)
    for (int64_t g = 0; g < G; g++) {
      const int64_t h = it.kh * G + g;
      store_normalized(P.out + ((start + it.q0 + r) * P.hq + h) * D, S.o[g][r], 1.0f / S.lo[g][r], D);
    }
}

// The calling thread's buffer for packed blocks, kept between calls (grown to the largest call seen) so that
// a step's layers do not map and fault in fresh pages each time.
struct PackBuffer {
  void* data = nullptr;
  size_t bytes = 0;
  ~PackBuffer() { std::free(data); }
  void* reserve(size_t need) {
    if (need > bytes) {
      std::free(data);
      bytes = (need + 63) / 64 * 64;
      data = std::aligned_alloc(64, bytes);
      if (data == nullptr) bytes = 0;
    }
    return data;
  }
};

template <int D>
void run(const Problem& P, int64_t B) {
  // 1. Pack every key block each sequence with queries reads, once for all its tiles: entry (j, kh) of
  //    sequence b at (first_block[b] + j) * hkv + kh.
  std::vector<int64_t> first_block(B + 1, 0);
  for (int64_t b = 0; b < B; b++) {
    const bool has_queries = P.starts[b + 1] > P.starts[b];
    first_block[b + 1] = first_block[b] + (has_queries ? (P.lens[b] + KEY_BLOCK - 1) / KEY_BLOCK : 0);
  }
  const int64_t entries = first_block[B] * P.hkv;
  thread_local PackBuffer buffer;
  auto* packed = static_cast<PackedBlock<D>*>(buffer.reserve(sizeof(PackedBlock<D>) * entries));
  STD_TORCH_CHECK(packed != nullptr, "extend_attention: out of memory");
  std::vector<int64_t> entry_seq(first_block[B]);
  for (int64_t b = 0; b < B; b++)
    for (int64_t j = first_block[b]; j < first_block[b + 1]; j++) entry_seq[j] = b;
  torch::stable::parallel_for(0, entries, 1, [&](int64_t begin, int64_t end) {
    for (int64_t e = begin; e < end; e++) {
      const int64_t j = e / P.hkv, kh = e % P.hkv, b = entry_seq[j];
      const int64_t k0 = (j - first_block[b]) * KEY_BLOCK;
      pack_block<D>(P, P.tables + b * P.table_stride, kh, k0,
                    static_cast<int>(std::min<int64_t>(KEY_BLOCK, P.lens[b] - k0)), packed[e]);
    }
  });

  // 2. Attend. Items of one (sequence, KV head) run one after another, last tile first: a thread's next item
  //    reads the packed K/V its previous one left in its cache. Sequences with the most work first, so the
  //    last items threads pick up are short. (The order decides only which thread runs what, never a result.)
  std::vector<int64_t> seqs(B);
  for (int64_t b = 0; b < B; b++) seqs[b] = b;
  auto work = [&](int64_t b) {
    const int64_t n_new = P.starts[b + 1] - P.starts[b];
    return n_new * (P.lens[b] - n_new / 2);
  };
  std::stable_sort(seqs.begin(), seqs.end(), [&](int64_t a, int64_t b) { return work(a) > work(b); });
  std::vector<Item> items;
  for (int64_t b : seqs) {
    const int64_t n_new = P.starts[b + 1] - P.starts[b];
    for (int64_t kh = 0; kh < P.hkv; kh++)
      for (int64_t q0 = (n_new - 1) / QUERY_TILE * QUERY_TILE; q0 >= 0; q0 -= QUERY_TILE)
        items.push_back(Item{b, kh, q0, std::min<int64_t>(QUERY_TILE, n_new - q0)});
  }
  std::atomic<int64_t> next{0};
  const int64_t count = static_cast<int64_t>(items.size());
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(torch::stable::get_num_threads(), count));
  torch::stable::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Scratch<D>* S = static_cast<Scratch<D>*>(std::aligned_alloc(64, (sizeof(Scratch<D>) + 63) / 64 * 64));
    STD_TORCH_CHECK(S != nullptr, "extend_attention: out of memory");
    std::vector<const PackedBlock<D>*> blocks;
    for (int64_t i = next.fetch_add(1); i < count; i = next.fetch_add(1)) {
      const Item& it = items[i];
      blocks.clear();
      for (int64_t j = first_block[it.b]; j < first_block[it.b + 1]; j++) blocks.push_back(&packed[j * P.hkv + it.kh]);
      attend_item<D>(P, it, blocks.data(), *S);
    }
    std::free(S);
  });
}

Tensor extend_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens,
                        Tensor query_start_loc, double scale) {
  STD_TORCH_CHECK(cpu_supported(), "extend_attention: this CPU lacks AVX512-BF16");
  STD_TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4 && block_tables.dim() == 2 &&
                      seq_lens.dim() == 1 && query_start_loc.dim() == 1,
                  "extend_attention: q [T, Hq, D], caches [blocks, block_size, Hkv, D], tables [B, M], lens [B], "
                  "query_start_loc [B + 1]");
  STD_TORCH_CHECK(q.scalar_type() == ScalarType::BFloat16 && k_cache.scalar_type() == ScalarType::BFloat16 &&
                      v_cache.scalar_type() == ScalarType::BFloat16,
                  "extend_attention: q and the caches must be bfloat16");
  STD_TORCH_CHECK(block_tables.scalar_type() == ScalarType::Int && seq_lens.scalar_type() == ScalarType::Int &&
                      query_start_loc.scalar_type() == ScalarType::Int,
                  "extend_attention: block_tables, seq_lens and query_start_loc must be int32");
  const int64_t T = q.size(0), hq = q.size(1), D = q.size(2);
  const int64_t nb = k_cache.size(0), bs = k_cache.size(1), hkv = k_cache.size(2);
  const int64_t B = seq_lens.size(0);
  STD_TORCH_CHECK(k_cache.size(3) == D && v_cache.size(0) == nb && v_cache.size(1) == bs && v_cache.size(2) == hkv &&
                      v_cache.size(3) == D,
                  "extend_attention: cache shapes disagree with q");
  STD_TORCH_CHECK(hkv > 0 && hq % hkv == 0 && hq / hkv <= MAX_GROUP,
                  "extend_attention: query heads must be 1 to 16 times the KV heads");
  STD_TORCH_CHECK(D == 32 || D == 64 || D == 128, "extend_attention: head_dim must be 32, 64 or 128");
  STD_TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "extend_attention: caches must be contiguous");
  STD_TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == D, "extend_attention: q's heads must be dense rows");
  STD_TORCH_CHECK(block_tables.size(0) == B && query_start_loc.size(0) == B + 1 && block_tables.stride(1) == 1 &&
                      seq_lens.stride(0) == 1 && query_start_loc.stride(0) == 1,
                  "extend_attention: block_tables [B, M] (dense rows), seq_lens [B], query_start_loc [B + 1]");
  STD_TORCH_CHECK(q.is_cpu() && k_cache.is_cpu() && block_tables.is_cpu() && seq_lens.is_cpu() &&
                      query_start_loc.is_cpu(),
                  "extend_attention: CPU tensors only");

  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.const_data_ptr<int32_t>();
  const int32_t* tables = block_tables.const_data_ptr<int32_t>();
  const int64_t M = block_tables.size(1), tstride = block_tables.stride(0);
  STD_TORCH_CHECK(B == 0 || (starts[0] == 0 && starts[B] == T),
                  "extend_attention: query_start_loc must run from 0 to the number of queries");
  for (int64_t b = 0; b < B; b++) {  // every block a sequence reads must exist: checked before any read
    const int64_t n = starts[b + 1] - starts[b];
    STD_TORCH_CHECK(n >= 0, "extend_attention: query_start_loc must not decrease");
    if (n == 0) continue;
    STD_TORCH_CHECK(lens[b] >= n && lens[b] <= M * bs, "extend_attention: seq_lens[", b, "] = ", lens[b],
                    " is outside [", n, ", ", M * bs, "]");
    for (int64_t j = 0; j < (lens[b] + bs - 1) / bs; j++)
      STD_TORCH_CHECK(tables[b * tstride + j] >= 0 && tables[b * tstride + j] < nb,
                      "extend_attention: block id out of range in block_tables[", b, "]");
  }
  Tensor out = torch::stable::new_empty(q, {T, hq, D});
  if (T == 0) return out;
  Problem P{static_cast<const uint16_t*>(q.const_data_ptr()), q.stride(0),
            static_cast<const uint16_t*>(k_cache.const_data_ptr()),
            static_cast<const uint16_t*>(v_cache.const_data_ptr()), tables, tstride, lens, starts, hq, hkv, bs,
            static_cast<float>(scale) * LOG2E, static_cast<uint16_t*>(out.mutable_data_ptr())};
  if (D == 32) run<32>(P, B);
  else if (D == 64) run<64>(P, B);
  else run<128>(P, B);
  return out;
}

bool supported() { return cpu_supported(); }

}  // namespace

STABLE_TORCH_LIBRARY(phaseserve_extend_attention, m) {
  m.def("extend_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "Tensor query_start_loc, float scale) -> Tensor");
  m.def("supported() -> bool");
}

STABLE_TORCH_LIBRARY_IMPL(phaseserve_extend_attention, CPU, m) {
  m.impl("extend_attention", TORCH_BOX(&extend_attention));
}

STABLE_TORCH_LIBRARY_IMPL(phaseserve_extend_attention, CompositeExplicitAutograd, m) {
  m.impl("supported", TORCH_BOX(&supported));
}
