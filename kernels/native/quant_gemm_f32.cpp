// y = x @ W^T for a block-quantized W (blocks of 32 weights along K with an fp16 scale d, and for int4 an
// fp16 offset m: w = d*q (int8), w = d*q + m (int4)), float32 activations, for CPUs with AVX2 + FMA.
//
// The same kernels also read bf16-stored weights (a bf16 checkpoint served in float32: bf16_linear, no scales,
// acc += s per block).
//
// Built against torch's stable ABI (torch/csrc/stable). Registered as
// torch.ops.phaseserve_quant_gemm_f32.{quant_linear, bf16_linear, supported}.
//
// Layout (kernels/native_quant_f32.py packs it at load): outputs in groups of 8 (one ymm of fp32, lane i =
// output i, so the activation is a broadcast and no horizontal sums are needed); for each group and block,
// the block's quantized values k by k (int8: 8 bytes a k; int4: 16 bytes per 4 k, k and k+1 in the low and
// high nibbles of bytes 0..7, k+2 and k+3 of bytes 8..15), then the group's 8 fp16 scales (and offsets).
// A group is one contiguous stream, prefetched ahead; the last group is padded with zero weights.
//
// Numerics: the scales are applied once per block, to the block's fp32 sum of q x (q unpacked to exact fp32
// integers): for each block in order, s = fma chain over its 32 k ascending from 0, then
//   acc = fma(d, s, acc)                 (int8: w = d q)
//   acc = fma(m, X, fma(d, s, acc))      (int4: w = d q + m; X = the row's block sum of x, one fixed order)
// which is the dequantized weights' product with fewer roundings and half the multiply-adds of scaling
// each weight. Both paths below compute exactly that sequence, so a row's result is bit-identical
// whatever the other rows of the call, the row tile it lands in, the path, and the thread count (threads
// split the outputs, never k):
// - few rows (decode): quantized values unpacked in registers and used at once by a tile of rows;
// - from DEQUANT_ROWS rows (prefill): a chunk of groups unpacked once into fp32 buffers (q exact, scales)
//   that stay in cache, and a 6-row x 16-output fp32 kernel runs every row over them (compute-bound).

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/util/Exception.h>

#include <immintrin.h>

#include "cpu_features.h"
#include "op_args.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

using torch::stable::Tensor;
using torch::headeronly::ScalarType;

constexpr int BLOCK = 32;
constexpr int LANES = 8;  // outputs per group (one ymm of fp32)

// BITS: 4 (int4, w = d q + m), 8 (int8, w = d q) or 16 (bf16 weights, as stored: no scales)
template <int BITS>
constexpr int64_t quant_bytes() { return BLOCK * LANES * BITS / 8; }

// a block of one group: its quantized values, 8 fp16 scales, (int4) 8 fp16 offsets
template <int BITS>
constexpr int64_t block_bytes() { return quant_bytes<BITS>() + (BITS == 4 ? 32 : BITS == 8 ? 16 : 0); }

constexpr int64_t PREFETCH_BLOCKS = 4;  // how far ahead a group's stream is prefetched
constexpr int64_t CHUNK_GROUPS = 4;     // groups unpacked at once (prefill)
constexpr int64_t DECODE_GROUPS = 8;    // groups a thread takes through every row tile (decode)
constexpr int64_t DEQUANT_ROWS = 6;     // from this many rows on, unpack once per chunk (same results)

struct Packed {
  const uint8_t* data;  // [groups, blocks, block_bytes<BITS>()]
  int64_t nblocks, groups, n;  // n: real outputs (the last group may be partly padding)
};

// The block's 8 scales (and offsets) as fp32.
template <int BITS>
AVX2_FMA inline void block_scales(const uint8_t* blk, __m256& d, __m256& m) {
  const uint8_t* s = blk + quant_bytes<BITS>();
  d = BITS == 16 ? _mm256_set1_ps(1.0f) : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)s));
  m = BITS == 4 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(s + 16))) : _mm256_setzero_ps();
}

// The quantized values of k = 4j .. 4j+3 of a block for the group's 8 outputs, as exact fp32 integers:
// q[i] for k = 4j + i.
template <int BITS>
AVX2_FMA inline void unpack_quad(const uint8_t* blk, int j, __m256 q[4]) {
  if constexpr (BITS == 16) {  // bf16: the upper half of an fp32
    const uint8_t* p = blk + j * 4 * LANES * 2;
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++)
      q[i] = _mm256_castsi256_ps(
          _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(p + i * LANES * 2))), 16));
  } else if constexpr (BITS == 4) {
    const uint8_t* p = blk + j * 16;
    const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8)));
    const __m256i low = _mm256_set1_epi32(0x0F);
    q[0] = _mm256_cvtepi32_ps(_mm256_and_si256(a, low));
    q[1] = _mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4));
    q[2] = _mm256_cvtepi32_ps(_mm256_and_si256(b, low));
    q[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
  } else {
    const uint8_t* p = blk + j * 4 * LANES;
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++)
      q[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + i * LANES))));
  }
}

// acc += d * s (+ m * X): a block's sum s = sum(q x) scaled into the output, the one place both paths do it
// (bf16 weights: acc += s).
template <int BITS>
AVX2_FMA inline __m256 fold_block(__m256 acc, __m256 s, __m256 d, __m256 m, const float* xsum) {
  if constexpr (BITS == 16) return _mm256_add_ps(acc, s);
  acc = _mm256_fmadd_ps(d, s, acc);
  return BITS == 4 ? _mm256_fmadd_ps(m, _mm256_broadcast_ss(xsum), acc) : acc;
}

// Outputs of group g from acc: a masked store for the padded last group.
AVX2_FMA inline void store_group(const Packed& W, int64_t g, float* out, __m256 acc) {
  const int64_t valid = W.n - g * LANES;
  if (valid >= LANES) {
    _mm256_storeu_ps(out + g * LANES, acc);
  } else {
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(valid)),
                                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    _mm256_maskstore_ps(out + g * LANES, mask, acc);
  }
}

// Block sums of every activation row (int4's offset term), each in one fixed order.
AVX2_FMA void block_sums(const float* x, int64_t ldx, int64_t T, int64_t nblocks, float* xsum) {
  for (int64_t t = 0; t < T; t++)
    for (int64_t b = 0; b < nblocks; b++) {
      const float* p = x + t * ldx + b * BLOCK;
      const __m256 v = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)),
                                     _mm256_add_ps(_mm256_loadu_ps(p + 16), _mm256_loadu_ps(p + 24)));
      const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
      const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
      xsum[t * nblocks + b] = _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
    }
}

// The GCC unroll pragmas below make the (row, group) loops unroll before scalar replacement: without them
// GCC kept a memory copy of the accumulator arrays and stored it on every k.

// ---- few rows (decode): NW groups x TT rows over the whole K, weights unpacked in registers

template <int BITS, int NW, int TT>
AVX2_FMA void tile(const Packed& W, int64_t g0, const float* x, int64_t ldx, const float* xsum, float* out,
                   int64_t ldo) {
  constexpr int64_t BB = block_bytes<BITS>();
  __m256 acc[TT][NW];
#pragma GCC unroll 16
  for (int t = 0; t < TT; t++)
#pragma GCC unroll 16
    for (int w = 0; w < NW; w++) acc[t][w] = _mm256_setzero_ps();
  for (int64_t b = 0; b < W.nblocks; b++) {
    const uint8_t* blk[NW];
#pragma GCC unroll 16
    for (int w = 0; w < NW; w++) {
      blk[w] = W.data + ((g0 + w) * W.nblocks + b) * BB;
      // PREFETCH_BLOCKS ahead in each group's stream; near its end, the start of the next tile's groups
      // (each tile's first blocks would otherwise wait on DRAM)
      const int64_t ahead = b + PREFETCH_BLOCKS;
      const int64_t g = ahead < W.nblocks ? g0 + w : g0 + NW + w;
      if (g < W.groups) {
        const uint8_t* next = W.data + (g * W.nblocks + (ahead < W.nblocks ? ahead : ahead - W.nblocks)) * BB;
        for (int64_t line = 0; line < BB; line += 64) _mm_prefetch((const char*)(next + line), _MM_HINT_T0);
      }
    }
    __m256 s[TT][NW];
#pragma GCC unroll 16
    for (int t = 0; t < TT; t++)
#pragma GCC unroll 16
      for (int w = 0; w < NW; w++) s[t][w] = _mm256_setzero_ps();
    const float* xb = x + b * BLOCK;
    for (int j = 0; j < BLOCK / 4; j++) {
#pragma GCC unroll 16
      for (int w = 0; w < NW; w++) {
        __m256 q[4];
        unpack_quad<BITS>(blk[w], j, q);
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++)
#pragma GCC unroll 16
          for (int t = 0; t < TT; t++)
            s[t][w] = _mm256_fmadd_ps(q[i], _mm256_broadcast_ss(xb + t * ldx + 4 * j + i), s[t][w]);
      }
    }
#pragma GCC unroll 16
    for (int w = 0; w < NW; w++) {
      __m256 d, m;
      block_scales<BITS>(blk[w], d, m);
#pragma GCC unroll 16
      for (int t = 0; t < TT; t++) acc[t][w] = fold_block<BITS>(acc[t][w], s[t][w], d, m, xsum + t * W.nblocks + b);
    }
  }
#pragma GCC unroll 16
  for (int t = 0; t < TT; t++)
#pragma GCC unroll 16
    for (int w = 0; w < NW; w++) store_group(W, g0 + w, out + t * ldo, acc[t][w]);
}

// Rows [0, TT) against groups [g_begin, g_end): NW groups at a time, then single groups.
template <int BITS, int NW, int TT>
AVX2_FMA void row_tile(const Packed& W, int64_t g_begin, int64_t g_end, const float* x, int64_t ldx,
                       const float* xsum, float* out, int64_t ldo) {
  int64_t g = g_begin;
  for (; g + NW <= g_end; g += NW) tile<BITS, NW, TT>(W, g, x, ldx, xsum, out, ldo);
  for (; g < g_end; g++) tile<BITS, 1, TT>(W, g, x, ldx, xsum, out, ldo);
}

template <int BITS, int TT>
AVX2_FMA void rows_remainder(const Packed& W, int64_t g0, int64_t g1, const float* x, int64_t ldx,
                             const float* xsum, float* out, int64_t ldo, int64_t rows) {
  if constexpr (TT > 0) {
    if (rows == TT) row_tile<BITS, 2, TT>(W, g0, g1, x, ldx, xsum, out, ldo);
    else rows_remainder<BITS, TT - 1>(W, g0, g1, x, ldx, xsum, out, ldo, rows);
  }
}

// ---- many rows (prefill): a chunk of groups unpacked once to fp32, then a plain fp32 kernel

// Groups [g0, g0 + ng) as fp32 integers q [ng][K][8] and their scales d (and offsets m) [ng][nblocks][8].
template <int BITS>
AVX2_FMA void unpack_groups(const Packed& W, int64_t g0, int64_t ng, float* qbuf, float* dbuf, float* mbuf) {
  constexpr int64_t BB = block_bytes<BITS>();
  for (int64_t g = 0; g < ng; g++)
    for (int64_t b = 0; b < W.nblocks; b++) {
      const uint8_t* blk = W.data + ((g0 + g) * W.nblocks + b) * BB;
      __m256 d, m;
      block_scales<BITS>(blk, d, m);
      _mm256_storeu_ps(dbuf + (g * W.nblocks + b) * LANES, d);
      _mm256_storeu_ps(mbuf + (g * W.nblocks + b) * LANES, m);
      float* dst = qbuf + ((g * W.nblocks + b) * BLOCK) * LANES;
      for (int j = 0; j < BLOCK / 4; j++) {
        __m256 q[4];
        unpack_quad<BITS>(blk, j, q);
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(dst + (4 * j + i) * LANES, q[i]);
      }
    }
}

// NW groups (from chunk-local group w0) x TT rows over the whole K, from the unpacked buffers. The block
// sums live in registers; the outputs' sums in memory (touched once a block).
template <int BITS, int NW, int TT>
AVX2_FMA void tile_f32(const Packed& W, const float* qbuf, const float* dbuf, const float* mbuf, int64_t w0,
                       int64_t g0, const float* x, int64_t ldx, const float* xsum, float* out, int64_t ldo) {
  const int64_t K = W.nblocks * BLOCK;
  alignas(32) float acc[TT][NW][LANES] = {};
  for (int64_t b = 0; b < W.nblocks; b++) {
    __m256 s[TT][NW];
#pragma GCC unroll 16
    for (int t = 0; t < TT; t++)
#pragma GCC unroll 16
      for (int w = 0; w < NW; w++) s[t][w] = _mm256_setzero_ps();
    const float* wp = qbuf + (w0 * K + b * BLOCK) * LANES;
    const float* xb = x + b * BLOCK;
    for (int k = 0; k < BLOCK; k++) {
      __m256 q[NW];
#pragma GCC unroll 16
      for (int w = 0; w < NW; w++) q[w] = _mm256_loadu_ps(wp + (w * K + k) * LANES);
#pragma GCC unroll 16
      for (int t = 0; t < TT; t++) {
        const __m256 xv = _mm256_broadcast_ss(xb + t * ldx + k);
#pragma GCC unroll 16
        for (int w = 0; w < NW; w++) s[t][w] = _mm256_fmadd_ps(q[w], xv, s[t][w]);
      }
    }
#pragma GCC unroll 16
    for (int w = 0; w < NW; w++) {
      const __m256 d = _mm256_loadu_ps(dbuf + ((w0 + w) * W.nblocks + b) * LANES);
      const __m256 m = _mm256_loadu_ps(mbuf + ((w0 + w) * W.nblocks + b) * LANES);
#pragma GCC unroll 16
      for (int t = 0; t < TT; t++)
        _mm256_store_ps(acc[t][w], fold_block<BITS>(_mm256_load_ps(acc[t][w]), s[t][w], d, m,
                                                    xsum + t * W.nblocks + b));
    }
  }
  for (int t = 0; t < TT; t++)
    for (int w = 0; w < NW; w++) store_group(W, g0 + w0 + w, out + t * ldo, _mm256_load_ps(acc[t][w]));
}

template <int BITS, int TT>
AVX2_FMA void rows_f32(const Packed& W, const float* qbuf, const float* dbuf, const float* mbuf, int64_t g0,
                       int64_t ng, const float* x, int64_t ldx, const float* xsum, float* out, int64_t ldo) {
  int64_t w = 0;
  for (; w + 2 <= ng; w += 2) tile_f32<BITS, 2, TT>(W, qbuf, dbuf, mbuf, w, g0, x, ldx, xsum, out, ldo);
  for (; w < ng; w++) tile_f32<BITS, 1, TT>(W, qbuf, dbuf, mbuf, w, g0, x, ldx, xsum, out, ldo);
}

template <int BITS, int TT>
AVX2_FMA void rows_f32_remainder(const Packed& W, const float* qbuf, const float* dbuf, const float* mbuf,
                                 int64_t g0, int64_t ng, const float* x, int64_t ldx, const float* xsum, float* out,
                                 int64_t ldo, int64_t rows) {
  if constexpr (TT > 0) {
    if (rows == TT) rows_f32<BITS, TT>(W, qbuf, dbuf, mbuf, g0, ng, x, ldx, xsum, out, ldo);
    else rows_f32_remainder<BITS, TT - 1>(W, qbuf, dbuf, mbuf, g0, ng, x, ldx, xsum, out, ldo, rows);
  }
}

template <int BITS>
AVX2_FMA void gemm(const Packed& W, const float* x, int64_t ldx, int64_t T, float* out, int64_t ldo) {
  std::vector<float> xsum(BITS == 4 ? T * W.nblocks : 1);
  if (BITS == 4) block_sums(x, ldx, T, W.nblocks, xsum.data());
  const float* xs = xsum.data();
  if (T >= DEQUANT_ROWS) {
    torch::stable::parallel_for(0, W.groups, CHUNK_GROUPS, [&](int64_t begin, int64_t end) {
      const int64_t K = W.nblocks * BLOCK;
      std::vector<float> qbuf(CHUNK_GROUPS * K * LANES), dbuf(2 * CHUNK_GROUPS * W.nblocks * LANES);
      float* mbuf = dbuf.data() + CHUNK_GROUPS * W.nblocks * LANES;
      for (int64_t c = begin; c < end; c += CHUNK_GROUPS) {
        const int64_t ng = std::min(c + CHUNK_GROUPS, end) - c;
        unpack_groups<BITS>(W, c, ng, qbuf.data(), dbuf.data(), mbuf);
        int64_t t0 = 0;
        for (; t0 + 6 <= T; t0 += 6)
          rows_f32<BITS, 6>(W, qbuf.data(), dbuf.data(), mbuf, c, ng, x + t0 * ldx, ldx, xs + t0 * W.nblocks,
                            out + t0 * ldo, ldo);
        if (t0 < T)
          rows_f32_remainder<BITS, 5>(W, qbuf.data(), dbuf.data(), mbuf, c, ng, x + t0 * ldx, ldx,
                                      xs + t0 * W.nblocks, out + t0 * ldo, ldo, T - t0);
      }
    });
    return;
  }
  torch::stable::parallel_for(0, W.groups, DECODE_GROUPS, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; c += DECODE_GROUPS) {
      const int64_t c_end = std::min(c + DECODE_GROUPS, end);
      // 8 independent block sums in flight (FMA latency x throughput) at any row count
      if (T == 1) row_tile<BITS, 8, 1>(W, c, c_end, x, ldx, xs, out, ldo);
      else if (T == 2) row_tile<BITS, 4, 2>(W, c, c_end, x, ldx, xs, out, ldo);
      else {
        int64_t t0 = 0;
        for (; t0 + 4 <= T; t0 += 4)
          row_tile<BITS, 2, 4>(W, c, c_end, x + t0 * ldx, ldx, xs + t0 * W.nblocks, out + t0 * ldo, ldo);
        if (t0 < T)
          rows_remainder<BITS, 3>(W, c, c_end, x + t0 * ldx, ldx, xs + t0 * W.nblocks, out + t0 * ldo, ldo, T - t0);
      }
    }
  });
}

Tensor run(const char* name, Tensor x, Tensor packed, int64_t bits, int64_t n) {
  op_args::check_cpu(cpu_supports_avx2_fma(), name, "AVX2 + FMA");
  op_args::check_activations(x, op_args::F32, name);
  const int64_t T = x.size(0), K = x.size(1);
  op_args::check_packed(packed, bits == 4 ? block_bytes<4>() : bits == 8 ? block_bytes<8>() : block_bytes<16>(),
                        "ceil(N / 8)", K, BLOCK, name);
  const int64_t groups = packed.size(0), nblocks = packed.size(1);
  op_args::check_outputs(n, groups, LANES, name);
  Tensor out = torch::stable::new_empty(x, {T, n});
  if (T == 0 || n == 0) return out;
  Packed W{static_cast<const uint8_t*>(packed.const_data_ptr()), nblocks, groups, n};
  const float* xp = static_cast<const float*>(x.const_data_ptr());
  float* o = static_cast<float*>(out.mutable_data_ptr());
  if (bits == 4) gemm<4>(W, xp, x.stride(0), T, o, n);
  else if (bits == 8) gemm<8>(W, xp, x.stride(0), T, o, n);
  else gemm<16>(W, xp, x.stride(0), T, o, n);
  return out;
}

// x [T, K] float32 (dense rows); packed uint8 [ceil(N / 8), K / 32, block bytes] as
// kernels/native_quant_f32.py packs it; returns [T, N] float32.
Tensor quant_linear(Tensor x, Tensor packed, int64_t bits, int64_t n) {
  op_args::check_bits(bits, "quant_linear");
  return run("quant_linear", x, packed, bits, n);
}

// The same for a bf16 weight as stored (kernels/native_quant_f32.py pack_bf16): float32 activations.
Tensor bf16_linear(Tensor x, Tensor packed, int64_t n) { return run("bf16_linear", x, packed, 16, n); }

bool supported() { return cpu_supports_avx2_fma(); }

}  // namespace

STABLE_TORCH_LIBRARY(phaseserve_quant_gemm_f32, m) {
  m.def("quant_linear(Tensor x, Tensor packed, int bits, int n) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor packed, int n) -> Tensor");
  m.def("supported() -> bool");
}

STABLE_TORCH_LIBRARY_IMPL(phaseserve_quant_gemm_f32, CPU, m) {
  m.impl("quant_linear", TORCH_BOX(&quant_linear));
  m.impl("bf16_linear", TORCH_BOX(&bf16_linear));
}

PHASESERVE_SUPPORTED_IMPL(phaseserve_quant_gemm_f32)
