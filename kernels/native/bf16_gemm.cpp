// y = x @ W^T (+ bias) for a bf16 W, bf16 activations, for CPUs with AVX512-BF16: the linears of a bf16
// model, at every row count (decode steps of a few rows, prefill chunks of hundreds). Two multiplies over
// one layout: AMX tiles where the CPU has AMX-BF16 (Sapphire Rapids and later; the AMX section below), else
// vdpbf16ps (Zen 4). A CPU runs one of them at every row count, never both: their sums round differently in
// a few outputs, and one numerics wants a row's bits the same whatever the rows beside it.
//
// Built against torch's stable ABI (torch/csrc/stable): a few seconds to compile, no ATen headers.
// Registered as torch.ops.phaseserve_bf16_gemm.{bf16_linear, supported, amx}.
//
// Layout (kernels/native_bf16.py packs it once at load, a pure reshuffle): output rows in groups of 16,
// for each group its k-pairs in order, each one zmm of bf16 pairs (lane i = output 16g + i, k and k + 1),
// zero-padded to whole groups and pairs: [groups, K / 2, 32]. A group is one contiguous stream of
// 32 K bytes. A k-pair multiplies a broadcast pair of activations (vdpbf16ps), so each accumulator
// holds 16 outputs and needs no horizontal sum; 16 consecutive k-pairs of a group are one AMX B tile.
//
// Work (both multiplies): the groups are cut into chunks of ~256 KB; a chunk (taken by one thread) runs
// every row tile over its groups, so its weights come from DRAM once and from L2 for the other row tiles.
// vdpbf16ps: up to 24 accumulators, 4 groups x up to 6 rows, or 2 groups x up to 12 rows (AMX: 2 groups x
// up to 32 rows in four C tiles). Every tile prefetches its groups' streams ahead into L1; with several row
// tiles, the tiles of a chunk also prefetch the *next* chunk into L2, spread evenly over them: DRAM keeps
// streaming while the later row tiles run from cache (else memory and compute add up instead of
// overlapping).
//
// Every output sums its k-pairs in order 0, 1, ... in one fp32 accumulator (AMX: tdpbf16ps's own order
// within a k-tile of 16 pairs, the k-tiles in order, the partial one last), then adds the bias and rounds
// to bf16 once; no tile shape, row count or thread count changes that order (threads split groups and row
// blocks, never K), so a row's result does not depend on the rows beside it or on the threads (batch
// invariance).

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/util/Exception.h>

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "cpu_features.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace {

using torch::stable::Tensor;
using torch::headeronly::ScalarType;

constexpr int64_t GROUP = 16;                // outputs per group (one zmm of fp32)
constexpr int64_t LINE = 64;                 // bytes of one k-pair of one group: one cache line
constexpr int64_t CHUNK_BYTES = 256 * 1024;  // a chunk of groups: it and the next one fit in L2
constexpr int64_t NEAR_LINES = 32;           // how far ahead (k-pairs) a group's stream is prefetched

struct Packed {
  const uint16_t* data;  // [groups, kpairs, 32]
  int64_t groups, kpairs;
};

struct Rows {
  const uint16_t* x;     // [T, K] bf16, row stride ldx
  int64_t ldx, K;
  const float* bias;     // [groups * 16] fp32 (zeros without a bias)
  uint16_t* out;         // [T, N] bf16, row stride N
  int64_t N;
};

AVX512_BF16 inline __m512bh broadcast_pair(const uint16_t* x) {
  int32_t pair;
  std::memcpy(&pair, x, sizeof(pair));
  return (__m512bh)_mm512_set1_epi32(pair);
}

// NW groups from g0 x TT rows from t0, over the whole K. Prefetches pf_lines lines from pf into L2 on
// the way (a share of the next chunk).
template <int NW, int TT>
AVX512_BF16 void tile(const Packed& W, int64_t g0, const Rows& R, int64_t t0, const char* pf, int64_t pf_lines) {
  __m512 acc[TT][NW];
  for (int t = 0; t < TT; t++)
    for (int w = 0; w < NW; w++) acc[t][w] = _mm512_setzero_ps();
  const int64_t full = R.K / 2;
  const uint16_t* x = R.x + t0 * R.ldx;
  const uint16_t* wp = W.data + g0 * W.kpairs * 32;
  const int64_t pf_per_pair = full > 0 ? (pf_lines + full - 1) / full : 0;
  int64_t pf_done = 0;
  for (int64_t kp = 0; kp < full; kp++) {
    for (int64_t i = 0; i < pf_per_pair && pf_done < pf_lines; i++, pf_done++)
      _mm_prefetch(pf + pf_done * LINE, _MM_HINT_T1);
    // each group's own stream, NEAR_LINES ahead into L1 (past its end: the next group's start)
    for (int w = 0; w < NW; w++) _mm_prefetch((const char*)(wp + (w * W.kpairs + kp + NEAR_LINES) * 32), _MM_HINT_T0);
    __m512bh wv[NW];
    for (int w = 0; w < NW; w++) wv[w] = (__m512bh)_mm512_loadu_si512(wp + (w * W.kpairs + kp) * 32);
    for (int t = 0; t < TT; t++) {
      const __m512bh xv = broadcast_pair(x + t * R.ldx + 2 * kp);
      for (int w = 0; w < NW; w++) acc[t][w] = _mm512_dpbf16_ps(acc[t][w], wv[w], xv);
    }
  }
  if (R.K & 1) {  // the last k alone: its pair's other half is 0 in the activations and in the weights
    __m512bh wv[NW];
    for (int w = 0; w < NW; w++) wv[w] = (__m512bh)_mm512_loadu_si512(wp + (w * W.kpairs + full) * 32);
    for (int t = 0; t < TT; t++) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(x[t * R.ldx + R.K - 1]);
      for (int w = 0; w < NW; w++) acc[t][w] = _mm512_dpbf16_ps(acc[t][w], wv[w], xv);
    }
  }
  for (int w = 0; w < NW; w++) {
    const int64_t n0 = (g0 + w) * GROUP;
    const __m512 b = _mm512_loadu_ps(R.bias + n0);
    const int64_t valid = std::min<int64_t>(GROUP, R.N - n0);
    const __mmask16 mask = valid == GROUP ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
    for (int t = 0; t < TT; t++)
      _mm256_mask_storeu_epi16(R.out + (t0 + t) * R.N + n0, mask,
                               (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[t][w], b)));
  }
}

// tile<NW, rows> for a row count known only at run time (1 .. TT).
template <int NW, int TT>
AVX512_BF16 void tile_rows(int64_t rows, const Packed& W, int64_t g0, const Rows& R, int64_t t0, const char* pf,
                           int64_t pf_lines) {
  if constexpr (TT > 0) {
    if (rows == TT) tile<NW, TT>(W, g0, R, t0, pf, pf_lines);
    else tile_rows<NW, TT - 1>(rows, W, g0, R, t0, pf, pf_lines);
  }
}

// Groups [c0, c1) through every row tile; prefetches groups [n0, n1) (the next chunk) meanwhile.
template <int NW, int TT>
AVX512_BF16 void run_chunk(const Packed& W, int64_t c0, int64_t c1, int64_t n0, int64_t n1, const Rows& R, int64_t T) {
  const int64_t row_tiles = (T + TT - 1) / TT;
  const int64_t group_tiles = (c1 - c0) / NW + (c1 - c0) % NW;
  const int64_t tiles = row_tiles * group_tiles;
  const char* next = reinterpret_cast<const char*>(W.data + n0 * W.kpairs * 32);
  // one row tile: the near prefetch alone keeps DRAM streaming (an L2 prefetch a chunk ahead measured slower)
  const int64_t next_lines = row_tiles > 1 ? (n1 - n0) * W.kpairs : 0;
  int64_t i = 0;
  int64_t t0 = 0;
  for (int64_t r = 0; r < row_tiles; r++) {
    // balanced row tiles (T = 16: 8 + 8, not 12 + 4)
    const int64_t rows = (T - t0) / (row_tiles - r) + ((T - t0) % (row_tiles - r) != 0);
    int64_t g = c0;
    for (; g + NW <= c1; g += NW, i++) {
      const int64_t a = i * next_lines / tiles, b = (i + 1) * next_lines / tiles;
      tile_rows<NW, TT>(rows, W, g, R, t0, next + a * LINE, b - a);
    }
    for (; g < c1; g++, i++) {
      const int64_t a = i * next_lines / tiles, b = (i + 1) * next_lines / tiles;
      tile_rows<1, TT>(rows, W, g, R, t0, next + a * LINE, b - a);
    }
    t0 += rows;
  }
}

template <int NW, int TT>
AVX512_BF16 void gemm(const Packed& W, const Rows& R, int64_t T) {
  const int64_t group_bytes = W.kpairs * LINE;
  // whole tiles of NW groups per chunk, ~CHUNK_BYTES of weights
  const int64_t chunk = NW * std::max<int64_t>(1, CHUNK_BYTES / (NW * group_bytes));
  const int64_t chunks = (W.groups + chunk - 1) / chunk;
  torch::stable::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; c++) {
      const int64_t c0 = c * chunk, c1 = std::min(c0 + chunk, W.groups);
      const int64_t n1 = c + 1 < end ? std::min(c1 + chunk, W.groups) : c1;  // nothing after the last
      run_chunk<NW, TT>(W, c0, c1, c1, n1, R, T);
    }
  });
}

// ---- AMX (tile) path: CPUs with AMX-BF16 (Sapphire Rapids and later), at every row count ----
//
// The packed layout is already AMX's B layout: 16 consecutive k-pair lines of one group are one B tile
// (16 rows of 64 bytes: k-pair i holds the 16 outputs' bf16 pairs), and 32 consecutive activations of up
// to 16 rows are one A tile (read through the row stride). tdpbf16ps adds each row's 16 k-pairs into its
// fp32 C tile row. A block of up to 32 rows x 2 groups holds 4 C tiles, 2 A, 2 B (all 8 tiles) and runs
// its k-tiles 0, 1, ... in order over the whole K; the last, partial k-tile (K % 32) is copied zero-padded
// (activations and weights) and added last. Rows never mix inside a tile (each row's C row sums only its
// own A row), and K is never split, so a row's bits do not depend on the tile shapes, the row count or the
// threads: AMX gives other bits than the vdpbf16ps path above, but a CPU with AMX always runs this one.

constexpr int64_t KT = 16;                    // k-pairs per k-tile (64 bytes of an A row)
constexpr int64_t BTILE = KT * 2 * GROUP;     // bf16 of one B tile (1 KB)
constexpr int64_t AMX_NEAR_LINES = 64;        // how far ahead (k-pair lines) a B stream is prefetched
constexpr int64_t AMX_BIG_ROWS_BYTES = 1 << 20;  // activations past this take larger chunks

#define AMX_BF16 __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

// Tile numbers are immediates: g++'s _tile_* macros paste them as tokens, so templates go through asm.
// C(m, n) = tmm(2m + n), A(m) = tmm(4 + m), B(n) = tmm(6 + n).
template <int T>
AMX_BF16 inline void tile_load(const void* base, int64_t stride) {
  asm volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(base), "r"(stride), "i"(T) : "memory");
}
template <int T>
AMX_BF16 inline void tile_store(void* base, int64_t stride) {
  asm volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(base), "r"(stride), "i"(T) : "memory");
}
template <int T>
AMX_BF16 inline void tile_zero() {
  asm volatile("tilezero %%tmm%c0" ::"i"(T));
}
template <int C, int A, int B>
AMX_BF16 inline void tile_dp() {
  asm volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The tile shapes of a row block of m0 (+ m1) rows: ldtilecfg zeroes every tile, so it is loaded only when
// the shape changes (once per thread and call, twice with a partial last row block).
class Tiles {
 public:
  AMX_BF16 void shape(int m0, int m1) {
    if (m0 == m0_ && m1 == m1_) return;
    TileConfig cfg;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = LINE;
    cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = uint8_t(m0);
    cfg.rows[2] = cfg.rows[3] = cfg.rows[5] = uint8_t(m1 > 0 ? m1 : 1);
    cfg.rows[6] = cfg.rows[7] = uint8_t(KT);
    asm volatile("ldtilecfg %0" ::"m"(cfg) : "memory");
    m0_ = m0, m1_ = m1;
  }
  AMX_BF16 ~Tiles() {
    if (m0_ > 0) asm volatile("tilerelease" ::: "memory");  // back to the init state: cheap context switches
  }

 private:
  int m0_ = 0, m1_ = 0;
};

// The last, partial k-tile zero-padded: per row (A, 64 bytes each) and per group (B, one tile each).
struct KTail {
  int64_t kp0 = 0;              // its first k-pair (a multiple of KT); == kpairs: no tail
  const uint16_t* a = nullptr;  // [rows of the block, 32]
  const uint16_t* b = nullptr;  // [groups of the chunk, KT, 32], group c0 first
  int64_t c0 = 0;
};

// MT row tiles (m0, m1 rows from t0) x NT groups from g0, over the whole K; pf_lines lines from pf into L2
// on the way (a share of the next chunk).
template <int MT, int NT>
AMX_BF16 void amx_block(const Packed& W, int64_t g0, const Rows& R, int64_t t0, int m0, int m1, const KTail& tail,
                        const char* pf, int64_t pf_lines) {
  tile_zero<0>();
  if constexpr (NT == 2) tile_zero<1>();
  if constexpr (MT == 2) {
    tile_zero<2>();
    if constexpr (NT == 2) tile_zero<3>();
  }
  const int64_t lda = R.ldx * 2;
  const uint16_t* a0 = R.x + t0 * R.ldx;
  const uint16_t* a1 = a0 + m0 * R.ldx;
  const uint16_t* b0 = W.data + g0 * W.kpairs * 2 * GROUP;
  const uint16_t* b1 = b0 + W.kpairs * 2 * GROUP;
  const int64_t ktiles = tail.kp0 / KT;
  const int64_t pf_per_tile = ktiles > 0 ? (pf_lines + ktiles - 1) / ktiles : 0;
  int64_t pf_done = 0;
  for (int64_t kt = 0; kt < ktiles; kt++) {
    for (int64_t i = 0; i < pf_per_tile && pf_done < pf_lines; i++, pf_done++)
      _mm_prefetch(pf + pf_done * LINE, _MM_HINT_T1);
    // each group's stream AMX_NEAR_LINES ahead (past its end: the next group's start)
    const char* near0 = reinterpret_cast<const char*>(b0 + kt * BTILE) + AMX_NEAR_LINES * LINE;
    for (int i = 0; i < KT; i++) {
      _mm_prefetch(near0 + i * LINE, _MM_HINT_T0);
      if constexpr (NT == 2) _mm_prefetch(near0 + W.kpairs * LINE + i * LINE, _MM_HINT_T0);
    }
    tile_load<4>(a0 + kt * 2 * KT, lda);
    tile_load<6>(b0 + kt * BTILE, LINE);
    tile_dp<0, 4, 6>();
    if constexpr (NT == 2) {
      tile_load<7>(b1 + kt * BTILE, LINE);
      tile_dp<1, 4, 7>();
    }
    if constexpr (MT == 2) {
      tile_load<5>(a1 + kt * 2 * KT, lda);
      tile_dp<2, 5, 6>();
      if constexpr (NT == 2) tile_dp<3, 5, 7>();
    }
  }
  if (tail.kp0 < W.kpairs) {  // the partial k-tile, last as in K's order
    const uint16_t* tb = tail.b + (g0 - tail.c0) * BTILE;
    tile_load<4>(tail.a, LINE);
    tile_load<6>(tb, LINE);
    tile_dp<0, 4, 6>();
    if constexpr (NT == 2) {
      tile_load<7>(tb + BTILE, LINE);
      tile_dp<1, 4, 7>();
    }
    if constexpr (MT == 2) {
      tile_load<5>(tail.a + m0 * 2 * KT, LINE);
      tile_dp<2, 5, 6>();
      if constexpr (NT == 2) tile_dp<3, 5, 7>();
    }
  }
  alignas(64) float c[MT][NT][KT * GROUP];
  tile_store<0>(c[0][0], LINE);
  if constexpr (NT == 2) tile_store<1>(c[0][NT - 1], LINE);
  if constexpr (MT == 2) {
    tile_store<2>(c[MT - 1][0], LINE);
    if constexpr (NT == 2) tile_store<3>(c[MT - 1][NT - 1], LINE);
  }
  for (int n = 0; n < NT; n++) {
    const int64_t n0 = (g0 + n) * GROUP;
    const __m512 b = _mm512_loadu_ps(R.bias + n0);
    const int64_t valid = std::min<int64_t>(GROUP, R.N - n0);
    const __mmask16 mask = valid == GROUP ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
    for (int m = 0; m < MT; m++) {
      const int rows = m == 0 ? m0 : m1;
      const int64_t r0 = t0 + (m == 0 ? 0 : m0);
      for (int r = 0; r < rows; r++)
        _mm256_mask_storeu_epi16(R.out + (r0 + r) * R.N + n0, mask,
                                 (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(c[m][n] + r * GROUP), b)));
    }
  }
}

constexpr int64_t AMX_ROWS = 2 * KT;  // rows of a row block (two A tiles)

// Groups [c0, c1) through every row block; prefetches groups [n0, n1) (the next chunk) meanwhile.
AMX_BF16 void amx_chunk(Tiles& tiles, const Packed& W, int64_t c0, int64_t c1, int64_t n0, int64_t n1, const Rows& R,
                        int64_t T, std::vector<uint16_t>& scratch) {
  KTail tail;
  tail.kp0 = W.kpairs / KT * KT;
  tail.c0 = c0;
  const int64_t tail_pairs = W.kpairs - tail.kp0;
  if (tail_pairs > 0) {
    // [rows of a block, 32] activations, then [groups of the chunk, KT, 32] weights, zero-padded
    scratch.assign(AMX_ROWS * 2 * KT + (c1 - c0) * BTILE, 0);
    uint16_t* tb = scratch.data() + AMX_ROWS * 2 * KT;
    for (int64_t g = c0; g < c1; g++)
      std::memcpy(tb + (g - c0) * BTILE, W.data + (g * W.kpairs + tail.kp0) * 2 * GROUP, tail_pairs * LINE);
    tail.a = scratch.data();
    tail.b = tb;
  }
  const int64_t row_blocks = (T + AMX_ROWS - 1) / AMX_ROWS;
  const int64_t group_blocks = (c1 - c0 + 1) / 2;
  const int64_t blocks = row_blocks * group_blocks;
  const char* next = reinterpret_cast<const char*>(W.data + n0 * W.kpairs * 2 * GROUP);
  // one row block: the near prefetch alone keeps DRAM streaming
  const int64_t next_lines = row_blocks > 1 ? (n1 - n0) * W.kpairs : 0;
  int64_t i = 0;
  for (int64_t t0 = 0; t0 < T; t0 += AMX_ROWS) {
    const int rows = int(std::min<int64_t>(AMX_ROWS, T - t0));
    const int m0 = std::min<int>(rows, KT), m1 = rows - m0;
    tiles.shape(m0, m1);
    if (tail_pairs > 0) {
      uint16_t* ta = scratch.data();
      for (int r = 0; r < rows; r++)
        std::memcpy(ta + r * 2 * KT, R.x + (t0 + r) * R.ldx + 2 * tail.kp0, (R.K - 2 * tail.kp0) * sizeof(uint16_t));
    }
    for (int64_t g = c0; g < c1; g += 2, i++) {
      const int64_t a = i * next_lines / blocks, b = (i + 1) * next_lines / blocks;
      const char* pf = next + a * LINE;
      if (g + 2 <= c1) {
        if (m1 > 0) amx_block<2, 2>(W, g, R, t0, m0, m1, tail, pf, b - a);
        else amx_block<1, 2>(W, g, R, t0, m0, m1, tail, pf, b - a);
      } else {
        if (m1 > 0) amx_block<2, 1>(W, g, R, t0, m0, m1, tail, pf, b - a);
        else amx_block<1, 1>(W, g, R, t0, m0, m1, tail, pf, b - a);
      }
    }
  }
}

AMX_BF16 void amx_gemm(const Packed& W, const Rows& R, int64_t T) {
  const int64_t group_bytes = W.kpairs * LINE;
  // whole pairs of groups per chunk, ~CHUNK_BYTES of weights; where the activations outgrow L2 beside
  // them, each chunk reads them all again from L3, so larger chunks read them fewer times
  const int64_t chunk_bytes = T * R.K * 2 > AMX_BIG_ROWS_BYTES ? 4 * CHUNK_BYTES : CHUNK_BYTES;
  const int64_t chunk = 2 * std::max<int64_t>(1, chunk_bytes / (2 * group_bytes));
  const int64_t chunks = (W.groups + chunk - 1) / chunk;
  torch::stable::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    Tiles tiles;  // this thread's tile configuration, released when its share is done
    std::vector<uint16_t> scratch;
    for (int64_t c = begin; c < end; c++) {
      const int64_t c0 = c * chunk, c1 = std::min(c0 + chunk, W.groups);
      const int64_t n1 = c + 1 < end ? std::min(c1 + chunk, W.groups) : c1;  // nothing after the last
      amx_chunk(tiles, W, c0, c1, c1, n1, R, T, scratch);
    }
  });
}

// AMX-BF16 and AMX-TILE (cpuid leaf 7: edx bits 22 and 24), and Linux's permission to use the tile data
// state (asked once per process; without it the first tile instruction faults).
bool amx_here() {
  static const bool ok = [] {
    if (!cpu_supported()) return false;
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 22) & 1) || !((d >> 24) & 1)) return false;
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

// x [T, K] bf16 (dense rows); packed bf16 [ceil(N / 16), ceil(K / 2), 32] as kernels/native_bf16.py packs
// it; bias bf16 [N] or None; returns [T, N] bf16. amx: which multiply runs: -1 this CPU's (AMX tiles where it
// has AMX-BF16, what the dispatch passes), 0 vdpbf16ps, 1 AMX tiles (tests and benchmarks force either).
Tensor bf16_linear(Tensor x, Tensor packed, std::optional<Tensor> bias, int64_t n, int64_t amx) {
  STD_TORCH_CHECK(cpu_supported(), "bf16_linear: this CPU lacks AVX512-BF16");
  STD_TORCH_CHECK(amx >= -1 && amx <= 1, "bf16_linear: amx must be -1 (this CPU's), 0 (vdpbf16ps) or 1 (AMX)");
  STD_TORCH_CHECK(amx != 1 || amx_here(), "bf16_linear: amx=1 on a CPU without AMX-BF16 (or Linux refused the tile state)");
  STD_TORCH_CHECK(x.dim() == 2 && x.scalar_type() == ScalarType::BFloat16 && x.stride(1) == 1,
                  "bf16_linear: x must be bfloat16 [T, K] with dense rows");
  STD_TORCH_CHECK(x.is_cpu() && packed.is_cpu(), "bf16_linear: CPU tensors only");
  const int64_t T = x.size(0), K = x.size(1);
  STD_TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == ScalarType::BFloat16 &&
                      packed.size(2) == 2 * GROUP,
                  "bf16_linear: packed must be contiguous bfloat16 [N / 16, K / 2, 32]");
  const int64_t groups = packed.size(0), kpairs = packed.size(1);
  STD_TORCH_CHECK(kpairs == (K + 1) / 2, "bf16_linear: x has ", K, " features, the weight ", 2 * kpairs);
  STD_TORCH_CHECK(n > (groups - 1) * GROUP && n <= groups * GROUP, "bf16_linear: ", n,
                  " outputs do not fit a weight of ", groups, " groups of 16");
  std::vector<float> bias32(groups * GROUP, 0.0f);
  if (bias.has_value()) {
    const Tensor& b = *bias;
    STD_TORCH_CHECK(b.dim() == 1 && b.size(0) == n && b.scalar_type() == ScalarType::BFloat16 && b.is_contiguous() &&
                        b.is_cpu(),
                    "bf16_linear: bias must be contiguous bfloat16 [", n, "]");
    const uint16_t* bp = static_cast<const uint16_t*>(b.const_data_ptr());
    for (int64_t i = 0; i < n; i++) {
      const uint32_t bits = uint32_t(bp[i]) << 16;
      std::memcpy(&bias32[i], &bits, sizeof(float));
    }
  }
  Tensor out = torch::stable::new_empty(x, {T, n});
  if (T == 0 || n == 0) return out;
  const Packed W{static_cast<const uint16_t*>(packed.const_data_ptr()), groups, kpairs};
  const Rows R{static_cast<const uint16_t*>(x.const_data_ptr()), x.stride(0), K, bias32.data(),
               static_cast<uint16_t*>(out.mutable_data_ptr()), n};
  if (amx == 1 || (amx == -1 && amx_here())) {
    amx_gemm(W, R, T);
    return out;
  }
  // up to 24 accumulators (32 zmm registers): one tile of 4 groups x T rows up to 6 rows (several groups
  // keep enough multiply-adds in flight), else tiles of 2 groups x up to 12 rows (fewer loads per
  // multiply-add than 4 x 6; measured ~equal or better at 8-32 rows)
  if (T <= 6) gemm<4, 6>(W, R, T);
  else gemm<2, 12>(W, R, T);
  return out;
}

bool supported() { return cpu_supported(); }

// True where bf16_linear runs AMX tiles by default (amx=-1).
bool amx_available() { return amx_here(); }

}  // namespace

STABLE_TORCH_LIBRARY(phaseserve_bf16_gemm, m) {
  m.def("bf16_linear(Tensor x, Tensor packed, Tensor? bias, int n, int amx=-1) -> Tensor");
  m.def("supported() -> bool");
  m.def("amx() -> bool");
}

STABLE_TORCH_LIBRARY_IMPL(phaseserve_bf16_gemm, CPU, m) {
  m.impl("bf16_linear", TORCH_BOX(&bf16_linear));
}

STABLE_TORCH_LIBRARY_IMPL(phaseserve_bf16_gemm, CompositeExplicitAutograd, m) {
  m.impl("supported", TORCH_BOX(&supported));
  m.impl("amx", TORCH_BOX(&amx_available));
}
