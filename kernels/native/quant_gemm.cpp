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
// From UNPACKED_ROWS rows on (prefill), a chunk of groups is unpacked once into a buffer of those exact
// bf16 integers that stays in cache, and the same tiles read it instead of unpacking per row tile. One
// arithmetic at every row count: how rows are tiled and where the integers come from only change which
// accumulator chains run side by side, so a row's outputs have the same bits whatever the rows beside it
// or the thread count (a prefill regime that dequantized to bf16, rounding the weights, then ran a plain
// bf16 GEMM gave a position other bits than its decode).

#pragma GCC optimize("fp-contract=off")  // only the FMAs written out: every regime the same bits

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/util/Exception.h>

#include <immintrin.h>

#include "cpu_features.h"

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

// NW groups (16 * NW outputs from group g0) x TT activation rows, over the whole K.
// xsum [TT rows, nblocks]: each row's block sums (int4's offset term). With `unpacked` (a chunk's buffer,
// unpack_groups, from group u0 on), the k-pairs come from it instead of being unpacked here.
template <bool INT4, int NW, int TT>
AVX512_BF16 void tile(const Packed& W, int64_t g0, const uint16_t* x, int64_t ldx, const float* xsum,
                      uint16_t* out, int64_t ldo, const __m512i* unpacked = nullptr, int64_t u0 = 0) {
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
    for (int w = 0; w < NW && unpacked == nullptr; w++) {
      const int64_t ahead = b + PREFETCH_BLOCKS;
      const int64_t g = ahead < W.nblocks ? g0 + w : g0 + NW + w;
      if (g < W.groups) {
        const uint8_t* next = W.data + (g * W.nblocks + (ahead < W.nblocks ? ahead : ahead - W.nblocks)) * BB;
        for (int64_t line = 0; line < BB; line += 64) _mm_prefetch((const char*)(next + line), _MM_HINT_T0);
      }
    }
    const uint16_t* xb = x + b * BLOCK;
    for (int p = 0; p < PAIRS; p++) {
      __m512bh wv[NW];
      for (int w = 0; w < NW; w++)
        wv[w] = unpacked ? (__m512bh)_mm512_load_si512(unpacked + ((g0 + w - u0) * W.nblocks + b) * PAIRS + p)
                         : unpack_pair<INT4>(qp[w] + p * PB);
      for (int t = 0; t < TT; t++) {
        const __m512bh xv = broadcast_pair(xb + t * ldx + 2 * p);
        for (int w = 0; w < NW; w++) blk[t][w] = _mm512_dpbf16_ps(blk[t][w], wv[w], xv);
      }
    }
    for (int w = 0; w < NW; w++) {
      const uint8_t* s = qp[w] + PAIRS * PB;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)s));
      if constexpr (INT4) {
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(s + 32)));
        const __m512 offset = _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), d, m);  // m - 128 d
        for (int t = 0; t < TT; t++)
          acc[t][w] = _mm512_fmadd_ps(offset, _mm512_set1_ps(xsum[t * W.nblocks + b]),
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
template <bool INT4, int NW, int TT>
AVX512_BF16 void row_tile(const Packed& W, int64_t g_begin, int64_t g_end, const uint16_t* x, int64_t ldx,
                          const float* xsum, uint16_t* out, int64_t ldo, const __m512i* unpacked = nullptr) {
  int64_t g = g_begin;
  for (; g + NW <= g_end; g += NW) tile<INT4, NW, TT>(W, g, x, ldx, xsum, out, ldo, unpacked, g_begin);
  for (; g < g_end; g++) tile<INT4, 1, TT>(W, g, x, ldx, xsum, out, ldo, unpacked, g_begin);
}

template <bool INT4, int TT>
AVX512_BF16 void rows_remainder(const Packed& W, int64_t g0, int64_t g1, const uint16_t* x, int64_t ldx,
                                const float* xsum, uint16_t* out, int64_t ldo, int64_t rows,
                                const __m512i* unpacked = nullptr) {
  if constexpr (TT > 0) {
    if (rows == TT) row_tile<INT4, 2, TT>(W, g0, g1, x, ldx, xsum, out, ldo, unpacked);
    else rows_remainder<INT4, TT - 1>(W, g0, g1, x, ldx, xsum, out, ldo, rows, unpacked);
  }
}

// Groups [g0, g0 + ng)'s k-pairs as the exact bf16 integers unpack_pair gives: buf [ng][nblocks][PAIRS].
template <bool INT4>
AVX512_BF16 void unpack_groups(const Packed& W, int64_t g0, int64_t ng, __m512i* buf) {
  constexpr int64_t PB = pair_bytes<INT4>(), BB = block_bytes<INT4>();
  for (int64_t g = 0; g < ng; g++)
    for (int64_t b = 0; b < W.nblocks; b++) {
      const uint8_t* blk = W.data + ((g0 + g) * W.nblocks + b) * BB;
      for (int p = 0; p < PAIRS; p++) _mm512_store_si512(buf + (g * W.nblocks + b) * PAIRS + p, (__m512i)unpack_pair<INT4>(blk + p * PB));
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

// From this many activation rows on, a chunk's k-pairs are unpacked once for all its row tiles.
constexpr int64_t UNPACKED_ROWS = 48;

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

template <bool INT4>
AVX512_BF16 void gemm(const Packed& W, const uint16_t* x, int64_t ldx, int64_t T, int64_t groups, uint16_t* out,
                      int64_t ldo) {
  std::vector<float> xsum(INT4 ? T * W.nblocks : 1);
  if (INT4) block_sums(x, ldx, T, W.nblocks, xsum.data());
  const float* xs = xsum.data();
  const bool unpack_once = T >= UNPACKED_ROWS;
  auto body = [&](int64_t begin, int64_t end) {
    thread_local UnpackBuffer buffer;
    __m512i* unpacked = unpack_once ? buffer.reserve(CHUNK_GROUPS * W.nblocks * PAIRS) : nullptr;
    for (int64_t c = begin; c < end; c += CHUNK_GROUPS) {
      const int64_t c_end = std::min(c + CHUNK_GROUPS, end);
      if (unpacked) unpack_groups<INT4>(W, c, c_end - c, unpacked);
      // up to 3 rows: more groups per tile keep enough accumulators in flight; else 2 groups x 6 rows
      if (T == 1) row_tile<INT4, 4, 1>(W, c, c_end, x, ldx, xs, out, ldo);
      else if (T == 2) row_tile<INT4, 4, 2>(W, c, c_end, x, ldx, xs, out, ldo);
      else if (T == 3) row_tile<INT4, 4, 3>(W, c, c_end, x, ldx, xs, out, ldo);
      else {
        int64_t t0 = 0;
        for (; t0 + 6 <= T; t0 += 6)
          row_tile<INT4, 2, 6>(W, c, c_end, x + t0 * ldx, ldx, xs + t0 * W.nblocks, out + t0 * ldo, ldo, unpacked);
        if (t0 < T)
          rows_remainder<INT4, 5>(W, c, c_end, x + t0 * ldx, ldx, xs + t0 * W.nblocks, out + t0 * ldo, ldo, T - t0,
                                  unpacked);
      }
    }
  };
  torch::stable::parallel_for(0, groups, CHUNK_GROUPS, body);
}

// x [T, K] bf16 (dense rows); packed uint8 [N / 16, K / 32, block bytes] as kernels/native_quant.py packs
// it; returns [T, N] bf16.
Tensor quant_linear(Tensor x, Tensor packed, int64_t bits) {
  STD_TORCH_CHECK(cpu_supported(), "quant_linear: this CPU lacks AVX512-BF16");
  STD_TORCH_CHECK(bits == 4 || bits == 8, "quant_linear: bits must be 4 or 8");
  STD_TORCH_CHECK(x.dim() == 2 && x.scalar_type() == ScalarType::BFloat16 && x.stride(1) == 1,
                  "quant_linear: x must be bfloat16 [T, K] with dense rows");
  STD_TORCH_CHECK(x.is_cpu() && packed.is_cpu(), "quant_linear: CPU tensors only");
  const int64_t bb = bits == 4 ? block_bytes<true>() : block_bytes<false>();
  STD_TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == ScalarType::Byte &&
                      packed.size(2) == bb,
                  "quant_linear: packed must be contiguous uint8 [N / 16, K / 32, ", bb, "]");
  const int64_t T = x.size(0), K = x.size(1), groups = packed.size(0), nblocks = packed.size(1);
  STD_TORCH_CHECK(K == nblocks * BLOCK, "quant_linear: x has ", K, " features, the weight ", nblocks * BLOCK);
  Tensor out = torch::stable::new_empty(x, {T, groups * GROUP});
  if (T == 0 || groups == 0) return out;
  Packed W{static_cast<const uint8_t*>(packed.const_data_ptr()), nblocks, groups};
  const uint16_t* xp = static_cast<const uint16_t*>(x.const_data_ptr());
  uint16_t* o = static_cast<uint16_t*>(out.mutable_data_ptr());
  if (bits == 4) gemm<true>(W, xp, x.stride(0), T, groups, o, groups * GROUP);
  else gemm<false>(W, xp, x.stride(0), T, groups, o, groups * GROUP);
  return out;
}

bool supported() { return cpu_supported(); }

}  // namespace

STABLE_TORCH_LIBRARY(phaseserve_quant_gemm, m) {
  m.def("quant_linear(Tensor x, Tensor packed, int bits) -> Tensor");
  m.def("supported() -> bool");
}

STABLE_TORCH_LIBRARY_IMPL(phaseserve_quant_gemm, CPU, m) {
  m.impl("quant_linear", TORCH_BOX(&quant_linear));
}

STABLE_TORCH_LIBRARY_IMPL(phaseserve_quant_gemm, CompositeExplicitAutograd, m) {
  m.impl("supported", TORCH_BOX(&supported));
}
