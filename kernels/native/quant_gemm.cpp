// y = x @ W^T for a block-quantized W (blocks of 32 weights along K with an fp16 scale d, and for int4 an
// fp16 offset m: w = d*q (int8), w = d*q + m (int4)), bf16 activations, for CPUs with AVX512-BF16.
//
// Built against torch's stable ABI (torch/csrc/stable): a few seconds to compile, no ATen headers.
// Registered as torch.ops.phaseserve_quant_gemm.{quant_linear, supported}.
//
// Layout (kernels/native_quant.py packs it at load): output rows in groups of 16; for each group and
// block, 16 k-pairs, each one zmm of bf16 pairs (lane i = output i, k and k+1) once unpacked, as
// oneDNN's bf16 GEMM lays out its weights, then the block's 16 fp16 scales (and int4 offsets): a group
// is one contiguous stream, read ahead with software prefetches (DRAM-bound at one activation row).
// A k-pair multiplies a broadcast pair of activations (vdpbf16ps), so accumulators hold 16 outputs and
// need no horizontal sum.
//
// The quantized values are unpacked to *exact* bf16 integers (int4: 128 + q by a shift and an OR,
// int8: q via fp32) and the scales are applied once per block to the block's fp32 sums:
//   y += d * sum(q' x) + (m - 128 d) * sum(x)     (int4, q' = 128 + q)
//   y += d * sum(q x)                              (int8)
// so unpacking costs 2 (int4) or 5 (int8) instructions per 32 weights and stays well below the
// multiply-adds even for one activation row, while rounding happens only in fp32 (the weights are
// never rounded to bf16). The weights are read once per tile of up to 6 activation rows.
//
// A block's sum(q' x) is one fp32 chain over its k-pairs, each pair added as vdpbf16ps adds it:
// fma(w[k], x[k], fma(w[k+1], x[k+1], sum)) for k even, denormals flushed. Intel's cores issue vdpbf16ps (32
// products) at half the rate of an fp32 FMA (16 products), so there, from 2 rows on, the pair runs as
// those two FMAs on the pair's halves (the k-odd and k-even weights, exact in fp32, and the activations
// widened to fp32): the same bits, faster (fp32_dots_here checks the bits on the CPU before using them).
//
// From UNPACKED_ROWS rows on (prefill; UNPACKED_ROWS_FMA with the FMAs), a chunk of groups is unpacked once
// into a buffer (the exact integers, as fp32 halves where the FMAs run, and the blocks' fp32 scales) that
// stays in cache, and tiles of 4 groups x 6 rows read it, their running sums in L1 so that the block sums
// alone fill the registers. One arithmetic at every row count: how rows are tiled, where the integers come
// from, where the running sums live and which instructions add a k-pair only change which chains run side by
// side, so a row's outputs have the same bits whatever the rows beside it or the thread count (a prefill
// regime that dequantized to bf16, rounding the weights, then ran a plain bf16 GEMM gave a position other
// bits than its decode).

#pragma GCC optimize("fp-contract=off")  // only the FMAs written out: every regime the same bits

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/util/Exception.h>

#include <immintrin.h>

#include "cpu_features.h"
#include "op_args.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

using torch::stable::Tensor;
using torch::headeronly::ScalarType;

constexpr int BLOCK = 32;
constexpr int PAIRS = BLOCK / 2;       // k-pairs per block
constexpr int GROUP = 16;              // output rows per group (one zmm of fp32)
constexpr int64_t CHUNK_GROUPS = 4;    // groups a thread takes through every row tile (stay in L1)

struct Packed {
  const uint8_t* data;  // [groups, blocks, block_bytes<INT4>()]
  int64_t nblocks, groups;
};

template <bool INT4>
constexpr int64_t pair_bytes() { return INT4 ? 16 : 32; }

// a block of one group: its k-pairs, 16 fp16 scales, (int4) 16 fp16 offsets
template <bool INT4>
constexpr int64_t block_bytes() { return PAIRS * pair_bytes<INT4>() + (INT4 ? 64 : 32); }

constexpr int64_t PREFETCH_BLOCKS = 4;  // how far ahead a group's stream is prefetched

// One k-pair of one group as exact bf16 integers. int4: a 128-bit broadcast of 16 bytes, its 16-bit words
// shifted right by 0 / 8 / 4 / 12 in the four 128-bit parts, leaves lane l's nibble in its low 4 bits (the
// packer stored each nibble where this puts it); OR 0x4300 makes the bf16 value 128 + q.
template <bool INT4>
AVX512_BF16 inline __m512bh unpack_pair(const uint8_t* p) {
  if constexpr (INT4) {
    const __m512i shifts = _mm512_setr_epi64(0, 0, 0x0008000800080008LL, 0x0008000800080008LL,
                                             0x0004000400040004LL, 0x0004000400040004LL,
                                             0x000C000C000C000CLL, 0x000C000C000C000CLL);
    const __m512i v = _mm512_srlv_epi16(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)p)), shifts);
    // (v & 0x000F) | 0x4300 in one ternary-logic op (A & B) | C
    return (__m512bh)_mm512_ternarylogic_epi32(v, _mm512_set1_epi16(0x000F), _mm512_set1_epi16(0x4300), 0xEA);
  } else {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 16))));
    return _mm512_cvtne2ps_pbh(hi, lo);
  }
}

AVX512_BF16 inline __m512bh broadcast_pair(const uint16_t* x) {
  int32_t pair;
  std::memcpy(&pair, x, sizeof(pair));
  return (__m512bh)_mm512_set1_epi32(pair);
}

// A k-pair of exact bf16 integers as two fp32 vectors: k even (the low halves), k odd (the high halves).
AVX512_BF16 inline __m512 even_half(__m512bh v) { return _mm512_castsi512_ps(_mm512_slli_epi32((__m512i)v, 16)); }
AVX512_BF16 inline __m512 odd_half(__m512bh v) {
  return _mm512_castsi512_ps(_mm512_and_si512((__m512i)v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// vdpbf16ps treats denormal inputs as zero and flushes denormal results whatever MXCSR says; with MXCSR's
// DAZ and FTZ set for the op (in every thread that runs it), the fp32 FMAs standing in for it, and the
// scaling in either arithmetic, flush them alike.
struct FlushDenormals {
  unsigned saved;
  FlushDenormals() : saved(_mm_getcsr()) { _mm_setcsr(saved | 0x8040); }
  ~FlushDenormals() { _mm_setcsr(saved); }
};

// The activation rows a tile reads: bf16 (for vdpbf16ps) or the same values as fp32 (for the FMAs), and
// each row's block sums (int4's offset term).
struct Rows {
  const uint16_t* x;
  int64_t ldx;
  const float* xf;  // [rows, K]
  int64_t ldf;
  const float* xsum;  // [rows, nblocks]
  int64_t nblocks;  // xsum's row stride (0 without xsum)
  Rows from(int64_t t0) const { return {x + t0 * ldx, ldx, xf + t0 * ldf, ldf, xsum + t0 * nblocks, nblocks}; }
};

// One k-pair (k, k + 1) of NW groups' weights wv into the block sums of TT rows: vdpbf16ps, or (FP32) the
// two FMAs that give its bits.
template <bool FP32, int NW, int TT>
AVX512_BF16 inline void pair_step(__m512 (&blk)[TT][NW], const __m512bh (&wv)[NW], const Rows& r, int64_t k) {
  if constexpr (FP32) {
    __m512 even[NW], odd[NW];
    for (int w = 0; w < NW; w++) even[w] = even_half(wv[w]), odd[w] = odd_half(wv[w]);
    for (int t = 0; t < TT; t++) {
      const __m512 xe = _mm512_set1_ps(r.xf[t * r.ldf + k]), xo = _mm512_set1_ps(r.xf[t * r.ldf + k + 1]);
      for (int w = 0; w < NW; w++) blk[t][w] = _mm512_fmadd_ps(even[w], xe, _mm512_fmadd_ps(odd[w], xo, blk[t][w]));
    }
  } else {
    for (int t = 0; t < TT; t++) {
      const __m512bh xv = broadcast_pair(r.x + t * r.ldx + k);
      for (int w = 0; w < NW; w++) blk[t][w] = _mm512_dpbf16_ps(blk[t][w], wv[w], xv);
    }
  }
}

// NW groups (16 * NW outputs from group g0) x TT activation rows, over the whole K, unpacking the weights
// in registers.
template <bool INT4, bool FP32, int NW, int TT>
AVX512_BF16 void tile(const Packed& W, int64_t g0, const Rows& r, uint16_t* out, int64_t ldo) {
  __m512 acc[TT][NW];
  for (int t = 0; t < TT; t++)
    for (int w = 0; w < NW; w++) acc[t][w] = _mm512_setzero_ps();
  constexpr int64_t PB = pair_bytes<INT4>(), BB = block_bytes<INT4>();
  for (int64_t b = 0; b < W.nblocks; b++) {
    __m512 blk[TT][NW];
    for (int t = 0; t < TT; t++)
      for (int w = 0; w < NW; w++) blk[t][w] = _mm512_setzero_ps();
    const uint8_t* qp[NW];
    for (int w = 0; w < NW; w++) qp[w] = W.data + ((g0 + w) * W.nblocks + b) * BB;
    // PREFETCH_BLOCKS ahead in each group's stream; near its end, the start of the next tile's groups
    // (each tile's first blocks would otherwise wait on DRAM)
    for (int w = 0; w < NW; w++) {
      const int64_t ahead = b + PREFETCH_BLOCKS;
      const int64_t g = ahead < W.nblocks ? g0 + w : g0 + NW + w;
      if (g < W.groups) {
        const uint8_t* next = W.data + (g * W.nblocks + (ahead < W.nblocks ? ahead : ahead - W.nblocks)) * BB;
        for (int64_t line = 0; line < BB; line += 64) _mm_prefetch((const char*)(next + line), _MM_HINT_T0);
      }
    }
    for (int p = 0; p < PAIRS; p++) {
      __m512bh wv[NW];
      for (int w = 0; w < NW; w++) wv[w] = unpack_pair<INT4>(qp[w] + p * PB);
      pair_step<FP32>(blk, wv, r, b * BLOCK + 2 * p);
    }
    for (int w = 0; w < NW; w++) {
      const uint8_t* s = qp[w] + PAIRS * PB;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)s));
      if constexpr (INT4) {
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(s + 32)));
        const __m512 offset = _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), d, m);  // m - 128 d
        for (int t = 0; t < TT; t++)
          acc[t][w] = _mm512_fmadd_ps(offset, _mm512_set1_ps(r.xsum[t * W.nblocks + b]),
                                      _mm512_fmadd_ps(blk[t][w], d, acc[t][w]));
      } else {
        for (int t = 0; t < TT; t++) acc[t][w] = _mm512_fmadd_ps(blk[t][w], d, acc[t][w]);
      }
    }
  }
  for (int t = 0; t < TT; t++)
    for (int w = 0; w < NW; w++)
      _mm256_storeu_si256((__m256i*)(out + t * ldo + (g0 + w) * GROUP), (__m256i)_mm512_cvtneps_pbh(acc[t][w]));
}

// Rows [t0, t0 + TT) against groups [g_begin, g_end): NW groups at a time, then single groups.
template <bool INT4, bool FP32, int NW, int TT>
AVX512_BF16 void row_tile(const Packed& W, int64_t g_begin, int64_t g_end, const Rows& r, uint16_t* out,
                          int64_t ldo) {
  int64_t g = g_begin;
  for (; g + NW <= g_end; g += NW) tile<INT4, FP32, NW, TT>(W, g, r, out, ldo);
  for (; g < g_end; g++) tile<INT4, FP32, 1, TT>(W, g, r, out, ldo);
}

template <bool INT4, bool FP32, int TT>
AVX512_BF16 void rows_remainder(const Packed& W, int64_t g0, int64_t g1, const Rows& r, uint16_t* out, int64_t ldo,
                                int64_t rows) {
  if constexpr (TT > 0) {
    if (rows == TT) row_tile<INT4, FP32, 2, TT>(W, g0, g1, r, out, ldo);
    else rows_remainder<INT4, FP32, TT - 1>(W, g0, g1, r, out, ldo, rows);
  }
}

// ---- many rows (prefill): a chunk of groups unpacked once into a buffer, read by every row tile

// zmm per block in the buffer: the k-pairs (one per pair, or with FP32 its odd and even halves as fp32),
// then the 16 scales d as fp32 and (int4) the offsets m - 128 d.
template <bool INT4, bool FP32>
constexpr int64_t buffered_block() { return (FP32 ? BLOCK : PAIRS) + (INT4 ? 2 : 1); }

// Groups [g0, g0 + ng) as the buffered tiles read them: buf [ng][nblocks][buffered_block()] zmm, the values
// (and the fp32 operation giving the offsets) those of the in-register tile.
template <bool INT4, bool FP32>
AVX512_BF16 void unpack_groups(const Packed& W, int64_t g0, int64_t ng, __m512i* buf) {
  constexpr int64_t PB = pair_bytes<INT4>(), BB = block_bytes<INT4>(), ZB = buffered_block<INT4, FP32>();
  constexpr int64_t WZ = FP32 ? BLOCK : PAIRS;  // zmm of weights per block
  for (int64_t g = 0; g < ng; g++)
    for (int64_t b = 0; b < W.nblocks; b++) {
      const uint8_t* blk = W.data + ((g0 + g) * W.nblocks + b) * BB;
      __m512i* dst = buf + (g * W.nblocks + b) * ZB;
      for (int p = 0; p < PAIRS; p++) {
        const __m512bh v = unpack_pair<INT4>(blk + p * PB);
        if constexpr (FP32) {
          _mm512_store_ps((float*)(dst + 2 * p), odd_half(v));  // in the order vdpbf16ps adds them
          _mm512_store_ps((float*)(dst + 2 * p + 1), even_half(v));
        } else {
          _mm512_store_si512(dst + p, (__m512i)v);
        }
      }
      const uint8_t* s = blk + PAIRS * PB;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)s));
      _mm512_store_ps((float*)(dst + WZ), d);
      if constexpr (INT4) {
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(s + 32)));
        _mm512_store_ps((float*)(dst + WZ + 1), _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), d, m));
      }
    }
}

// NW groups (chunk-local groups w0.., output groups g0 + w0..) x TT rows over the whole K from a chunk's
// buffer: the same operations per output as `tile`, but the running sums live in L1 (acc), not registers,
// so the block sums alone fill the registers and a tile can be 4 groups x 6 rows (each weight vector
// loaded once for 6 rows, each activation broadcast once for 4 groups) instead of 2 x 6.
template <bool INT4, bool FP32, int NW, int TT>
AVX512_BF16 void tile_buffered(const __m512i* buf, int64_t nblocks, int64_t w0, int64_t g0, const Rows& r,
                               uint16_t* out, int64_t ldo) {
  constexpr int64_t ZB = buffered_block<INT4, FP32>(), WZ = FP32 ? BLOCK : PAIRS;
  alignas(64) float acc[TT][NW][GROUP];
  for (int t = 0; t < TT; t++)
    for (int w = 0; w < NW; w++) _mm512_store_ps(acc[t][w], _mm512_setzero_ps());
  for (int64_t b = 0; b < nblocks; b++) {
    __m512 blk[TT][NW];
    for (int t = 0; t < TT; t++)
      for (int w = 0; w < NW; w++) blk[t][w] = _mm512_setzero_ps();
    const __m512i* wp[NW];
    for (int w = 0; w < NW; w++) wp[w] = buf + ((w0 + w) * nblocks + b) * ZB;
    if constexpr (FP32) {
      const float* xb = r.xf + b * BLOCK;
      for (int k = 0; k < BLOCK; k++) {  // slots 2p, 2p + 1: k-pair p's odd half, then its even half
        __m512 wv[NW];
        for (int w = 0; w < NW; w++) wv[w] = _mm512_load_ps((const float*)(wp[w] + k));
        for (int t = 0; t < TT; t++) {
          const __m512 xv = _mm512_set1_ps(xb[t * r.ldf + (k ^ 1)]);
          for (int w = 0; w < NW; w++) blk[t][w] = _mm512_fmadd_ps(wv[w], xv, blk[t][w]);
        }
      }
    } else {
      for (int p = 0; p < PAIRS; p++) {
        __m512bh wv[NW];
        for (int w = 0; w < NW; w++) wv[w] = (__m512bh)_mm512_load_si512(wp[w] + p);
        pair_step<false>(blk, wv, r, b * BLOCK + 2 * p);
      }
    }
    for (int w = 0; w < NW; w++) {
      const __m512 d = _mm512_load_ps((const float*)(wp[w] + WZ));
      for (int t = 0; t < TT; t++) {
        __m512 a = _mm512_fmadd_ps(blk[t][w], d, _mm512_load_ps(acc[t][w]));
        if constexpr (INT4)
          a = _mm512_fmadd_ps(_mm512_load_ps((const float*)(wp[w] + WZ + 1)),
                              _mm512_set1_ps(r.xsum[t * nblocks + b]), a);
        _mm512_store_ps(acc[t][w], a);
      }
    }
  }
  for (int t = 0; t < TT; t++)
    for (int w = 0; w < NW; w++)
      _mm256_storeu_si256((__m256i*)(out + t * ldo + (g0 + w0 + w) * GROUP),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(acc[t][w])));
}

// Rows [t0, t0 + TT) against a chunk's ng buffered groups (output groups from g0): 4 at a time, then single.
template <bool INT4, bool FP32, int TT>
AVX512_BF16 void rows_buffered(const __m512i* buf, int64_t nblocks, int64_t g0, int64_t ng, const Rows& r,
                               uint16_t* out, int64_t ldo) {
  int64_t w = 0;
  for (; w + 4 <= ng; w += 4) tile_buffered<INT4, FP32, 4, TT>(buf, nblocks, w, g0, r, out, ldo);
  for (; w < ng; w++) tile_buffered<INT4, FP32, 1, TT>(buf, nblocks, w, g0, r, out, ldo);
}

template <bool INT4, bool FP32, int TT>
AVX512_BF16 void rows_buffered_remainder(const __m512i* buf, int64_t nblocks, int64_t g0, int64_t ng, const Rows& r,
                                         uint16_t* out, int64_t ldo, int64_t rows) {
  if constexpr (TT > 0) {
    if (rows == TT) rows_buffered<INT4, FP32, TT>(buf, nblocks, g0, ng, r, out, ldo);
    else rows_buffered_remainder<INT4, FP32, TT - 1>(buf, nblocks, g0, ng, r, out, ldo, rows);
  }
}

// The calling thread's buffer of unpacked k-pairs, 64-byte aligned, kept between calls (grown to the
// largest seen).
struct UnpackBuffer {
  __m512i* data = nullptr;
  int64_t size = 0;
  ~UnpackBuffer() { std::free(data); }
  __m512i* reserve(int64_t n) {
    if (n > size) {
      std::free(data);
      data = static_cast<__m512i*>(std::aligned_alloc(64, sizeof(__m512i) * n));
      STD_TORCH_CHECK(data != nullptr, "quant_linear: out of memory");
      size = n;
    }
    return data;
  }
};

// From this many activation rows on, a chunk's k-pairs are unpacked once for all its row tiles; sooner with
// the FMAs, whose in-register tiles also split every k-pair into its halves.
constexpr int64_t UNPACKED_ROWS = 48, UNPACKED_ROWS_FMA = 32;

// Block sums of every activation row (fp32, of the bf16 values the multiply-adds see).
AVX512_BF16 void block_sums(const uint16_t* x, int64_t ldx, int64_t T, int64_t nblocks, float* xsum) {
  for (int64_t t = 0; t < T; t++)
    for (int64_t b = 0; b < nblocks; b++) {
      const __m512i v = _mm512_loadu_si512(x + t * ldx + b * BLOCK);
      const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), 16));
      const __m512 hi =
          _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), 16));
      xsum[t * nblocks + b] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
    }
}

// Every activation row as fp32 (exact), for the FMAs: xf [T, nblocks * BLOCK].
AVX512_BF16 void widen_rows(const uint16_t* x, int64_t ldx, int64_t T, int64_t nblocks, float* xf) {
  for (int64_t t = 0; t < T; t++)
    for (int64_t k = 0; k < nblocks * BLOCK; k += 16) {
      const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(x + t * ldx + k)));
      _mm512_storeu_ps(xf + t * nblocks * BLOCK + k, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
    }
}

template <bool INT4, bool FP32>
AVX512_BF16 void gemm(const Packed& W, const uint16_t* x, int64_t ldx, int64_t T, int64_t groups, uint16_t* out,
                      int64_t ldo) {
  const int64_t K = W.nblocks * BLOCK;
  std::vector<float> xsum(INT4 ? T * W.nblocks : 0), xf(FP32 ? T * K : 0);
  if (INT4) block_sums(x, ldx, T, W.nblocks, xsum.data());
  if (FP32) widen_rows(x, ldx, T, W.nblocks, xf.data());
  const Rows rows{x, ldx, xf.data(), FP32 ? K : 0, xsum.data(), INT4 ? W.nblocks : 0};
  const bool unpack_once = T >= (FP32 ? UNPACKED_ROWS_FMA : UNPACKED_ROWS);
  auto body = [&](int64_t begin, int64_t end) {
    FlushDenormals flush;
    thread_local UnpackBuffer buffer;
    __m512i* unpacked =
        unpack_once ? buffer.reserve(CHUNK_GROUPS * W.nblocks * buffered_block<INT4, FP32>()) : nullptr;
    for (int64_t c = begin; c < end; c += CHUNK_GROUPS) {
      const int64_t c_end = std::min(c + CHUNK_GROUPS, end);
      if (unpacked) {  // 4 groups x 6 rows from the buffer
        unpack_groups<INT4, FP32>(W, c, c_end - c, unpacked);
        int64_t t0 = 0;
        for (; t0 + 6 <= T; t0 += 6)
          rows_buffered<INT4, FP32, 6>(unpacked, W.nblocks, c, c_end - c, rows.from(t0), out + t0 * ldo, ldo);
        if (t0 < T)
          rows_buffered_remainder<INT4, FP32, 5>(unpacked, W.nblocks, c, c_end - c, rows.from(t0), out + t0 * ldo, ldo,
                                                 T - t0);
      } else if (T <= 3) {  // more groups per tile keep enough accumulators in flight
        if (T == 1) row_tile<INT4, FP32, 4, 1>(W, c, c_end, rows, out, ldo);
        else if (T == 2) row_tile<INT4, FP32, 4, 2>(W, c, c_end, rows, out, ldo);
        else row_tile<INT4, FP32, 4, 3>(W, c, c_end, rows, out, ldo);
      } else {  // 2 groups x 6 rows
        int64_t t0 = 0;
        for (; t0 + 6 <= T; t0 += 6) row_tile<INT4, FP32, 2, 6>(W, c, c_end, rows.from(t0), out + t0 * ldo, ldo);
        if (t0 < T) rows_remainder<INT4, FP32, 5>(W, c, c_end, rows.from(t0), out + t0 * ldo, ldo, T - t0);
      }
    }
  };
  torch::stable::parallel_for(0, groups, CHUNK_GROUPS, body);
}

// vdpbf16ps's lane i is fma(a[2i], b[2i], fma(a[2i+1], b[2i+1], c)) in fp32 (the order of Intel's manual),
// denormals flushed: probe that on this CPU with its exact weights (int4's 128 + q, int8's q) and others.
AVX512_BF16 bool fmas_match_dots() {
  FlushDenormals flush;
  uint32_t s = 0x9E3779B9u;
  auto next = [&s] { s ^= s << 13; s ^= s >> 17; s ^= s << 5; return s; };
  auto bf16 = [&](int spread) {  // sign, an exponent around 1 (or 0: zero and denormals), a mantissa
    const uint32_t r = next();
    const uint32_t e = r % 29 == 0 ? 0 : 127 + (r >> 8) % (2 * spread + 1) - spread;
    return static_cast<uint16_t>((r >> 31) << 15 | e << 7 | (r >> 16) % 128);
  };
  for (int it = 0; it < 4096; it++) {
    alignas(64) uint16_t a[32], b[32];
    alignas(64) float c[16];
    for (int i = 0; i < 32; i++) {
      const float q = static_cast<float>(static_cast<int>(next() % 255) - 127);
      uint32_t bits;
      std::memcpy(&bits, &q, sizeof(bits));
      a[i] = it % 3 == 0 ? 0x4300 | (next() & 15) : it % 3 == 1 ? bits >> 16 : bf16(30);
      b[i] = bf16(it % 2 ? 20 : 126);
    }
    for (int i = 0; i < 16; i++) {
      const uint32_t bits = static_cast<uint32_t>(bf16(it % 2 ? 20 : 126)) << 16 | (next() & 0xFFFF);
      std::memcpy(&c[i], &bits, sizeof(bits));
    }
    const __m512bh av = (__m512bh)_mm512_load_si512(a), bv = (__m512bh)_mm512_load_si512(b);
    const __m512 acc = _mm512_load_ps(c);
    const __m512 dot = _mm512_dpbf16_ps(acc, av, bv);
    const __m512 fmas =
        _mm512_fmadd_ps(even_half(av), even_half(bv), _mm512_fmadd_ps(odd_half(av), odd_half(bv), acc));
    if (_mm512_cmpneq_epi32_mask(_mm512_castps_si512(dot), _mm512_castps_si512(fmas)) != 0) return false;
  }
  return true;
}

// Whether this CPU's k-pair sums run as fp32 FMAs from 2 rows on: on Intel's AVX512-BF16 cores vdpbf16ps
// (32 products) issues at half the rate of an fp32 FMA (16 products), so two FMAs per k-pair multiply
// faster; AMD's issue it at the FMA's rate or faster. Only where the FMAs give vdpbf16ps's bits.
AVX512_BF16 bool fp32_dots_here() {
  __builtin_cpu_init();
  return __builtin_cpu_is("intel") && fmas_match_dots();
}

// x [T, K] bf16 (dense rows); packed uint8 [N / 16, K / 32, block bytes] as kernels/native_quant.py packs
// it; returns [T, N] bf16. dots: how the k-pair sums run: -1 as this CPU runs them best (what the dispatch
// asks), 0 vdpbf16ps at every row count, 1 fp32 FMAs at every row count (the tests compare them).
Tensor quant_linear(Tensor x, Tensor packed, int64_t bits, int64_t dots) {
  op_args::check_cpu(cpu_supported(), "quant_linear", "AVX512-BF16");
  op_args::check_bits(bits, "quant_linear");
  STD_TORCH_CHECK(dots >= -1 && dots <= 1, "quant_linear: dots must be -1 (this CPU's), 0 (bf16) or 1 (fp32)");
  op_args::check_activations(x, op_args::BF16, "quant_linear");
  const int64_t T = x.size(0), K = x.size(1);
  op_args::check_packed(packed, bits == 4 ? block_bytes<true>() : block_bytes<false>(), "N / 16", K, BLOCK,
                        "quant_linear");
  const int64_t groups = packed.size(0), nblocks = packed.size(1);
  Tensor out = torch::stable::new_empty(x, {T, groups * GROUP});
  if (T == 0 || groups == 0) return out;
  Packed W{static_cast<const uint8_t*>(packed.const_data_ptr()), nblocks, groups};
  const uint16_t* xp = static_cast<const uint16_t*>(x.const_data_ptr());
  uint16_t* o = static_cast<uint16_t*>(out.mutable_data_ptr());
  static const bool fp32_here = fp32_dots_here();
  // one row: vdpbf16ps (fewer instructions per weight, none of them waiting on another in its chain)
  const bool fp32 = dots == -1 ? fp32_here && T >= 2 : dots == 1;
  FlushDenormals flush;
  const int64_t ldx = x.stride(0), ldo = groups * GROUP;
  if (bits == 4) (fp32 ? gemm<true, true> : gemm<true, false>)(W, xp, ldx, T, groups, o, ldo);
  else (fp32 ? gemm<false, true> : gemm<false, false>)(W, xp, ldx, T, groups, o, ldo);
  return out;
}

bool supported() { return cpu_supported(); }

bool fp32_dots() { return cpu_supported() && fp32_dots_here(); }

}  // namespace

STABLE_TORCH_LIBRARY(phaseserve_quant_gemm, m) {
  m.def("quant_linear(Tensor x, Tensor packed, int bits, int dots=-1) -> Tensor");
  m.def("supported() -> bool");
  m.def("fp32_dots() -> bool");
}

STABLE_TORCH_LIBRARY_IMPL(phaseserve_quant_gemm, CPU, m) {
  m.impl("quant_linear", TORCH_BOX(&quant_linear));
}

PHASESERVE_SUPPORTED_IMPL(phaseserve_quant_gemm)

STABLE_TORCH_LIBRARY_IMPL(phaseserve_quant_gemm, CompositeExplicitAutograd, m) {
  m.impl("fp32_dots", TORCH_BOX(&fp32_dots));
}
