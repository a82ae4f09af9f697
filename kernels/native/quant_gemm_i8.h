// The int8-activation quantized matmul's kernels (see quant_gemm_i8.cpp for the op), in a header so that the
// fused decode layer (decode_layer_f32.cpp) runs the very same code: one copy of the arithmetic.
//
// y = x @ W^T for a block-quantized W (blocks of 32 weights along K, fp16 scale d, int4 also fp16 offset m:
// w = d q for int8 q, w = d q + m for uint4 q) with the float32 activations quantized to int8 first, for CPUs
// with AVX2 + FMA: the dot products run on integer instructions (vpmaddubsw / vpmaddwd), the way llama.cpp's
// AVX2 q4_0 x q8_0, q4_1 x q8_1 and q8_0 x q8_0 dot products do, instead of unpacking weights to fp32.
//
// Activations (Q8_0-style, one fp32 scale a block): per row and 32-element block, a = max |x|,
//   dx = a / 127,  q = round_half_even(x * (a ? 127 / a : 0))  (in [-127, 127]),  sx = dx * sum(q)
// (kernels/reference.py quantize_activations computes the same bits).
//
// Layout (kernels/native_quant_i8.py packs it at load): outputs in groups of 8; for each group and block, its
// 8 quads (k = 4j .. 4j + 3), each the 8 outputs' 4 values, byte 4o + i = output o at k = 4j + i (int8: 32
// bytes a quad; int4: 32 bytes a pair of quads, quad 2p in the low nibbles and 2p + 1 in the high ones), then
// the 8 fp16 scales, then (int4) the 8 fp16 offsets. A group is one contiguous stream; the last group is
// padded with zero weights.
//
// Numerics: for each row t, output o and block b, the block's integer dot product
//   S = sum_k qw[k] qx[k]   (exact in int32)
// is folded into the output's fp32 sum in block order:
//   acc = fma(float(S), d[o] * dx[t, b], acc)   then (int4)  acc = fma(m[o], sx[t, b], acc)
// Integer sums are exact whatever order the lanes add in, and that fp32 sequence is the same in every tile,
// so a row's output bits do not depend on how many rows the call has, which tile a row lands in, or the
// thread count (threads split the output groups, never K). One code path serves every row count: for each
// chunk of groups, tiles of 4 rows x 1 group (1 row: 4 or 8 groups); a quad of a group's block is unpacked
// once per tile and used by every row of it.
#pragma once

#include <torch/csrc/stable/ops.h>

#include <immintrin.h>

#include "cpu_features.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace i8 {

constexpr int BLOCK = 32;
constexpr int LANES = 8;             // outputs per group: lane o of a result vector is output o of the group
constexpr int64_t CHUNK_GROUPS = 8;  // groups a thread takes at once: their weights stay in cache over row tiles
constexpr int64_t PREFETCH_BLOCKS = 4;

template <int BITS>
constexpr int64_t quant_bytes() { return LANES * BLOCK * BITS / 8; }
template <int BITS>
constexpr int64_t block_bytes() { return quant_bytes<BITS>() + (BITS == 4 ? 32 : 16); }

struct Packed {
  const uint8_t* data;  // [groups, nblocks, block_bytes<BITS>()]
  int64_t nblocks, groups, n;
};

// Activations quantized, block-major so a block's rows are one contiguous run: q [nblocks][T][32], dx and sx
// [nblocks][T].
struct QuantRows {
  std::vector<int8_t> q;
  std::vector<float> d, s;
};

// One row's block of 32 floats -> 32 int8 at dst, its scale and scaled sum.
AVX2_FMA inline void quantize_block(const float* x, int8_t* dst, float* d, float* s) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(x + 8 * i);
  __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                           _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float amax = _mm_cvtss_f32(h);
  const float inv = amax != 0.0f ? 127.0f / amax : 0.0f;
  const __m256 mul = _mm256_set1_ps(inv);
  __m256i q[4];
  for (int i = 0; i < 4; i++)
    q[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], mul), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const __m256i total = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  t = _mm_add_epi32(t, _mm_unpackhi_epi64(t, t));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1)));
  // int32 -> int8: the packs interleave 128-bit lanes; the permute puts the 8 4-element runs back in order
  const __m256i w16 = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  _mm256_storeu_si256((__m256i*)dst, _mm256_permutevar8x32_epi32(w16, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  *d = amax / 127.0f;
  *s = *d * static_cast<float>(_mm_cvtsi128_si32(t));
}

AVX2_FMA inline void quantize_rows(const float* x, int64_t ldx, int64_t T, int64_t nblocks, int8_t* q, float* d,
                                   float* s) {
  torch::stable::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; t++)
      for (int64_t b = 0; b < nblocks; b++)
        quantize_block(x + t * ldx + b * BLOCK, q + (b * T + t) * BLOCK, d + b * T + t, s + b * T + t);
  });
}

// Outputs of group g from acc: a masked store for the padded last group.
AVX2_FMA inline void store_group(const Packed& W, int64_t g, float* out, __m256 acc) {
  const int64_t valid = W.n - g * LANES;
  if (valid >= LANES) {
    _mm256_storeu_ps(out + g * LANES, acc);
    return;
  }
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(valid)),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  _mm256_maskstore_ps(out + g * LANES, mask, acc);
}

// NG groups (from g0) x TR rows (from t0) over the whole K, the running sums in registers. A quad (k = 4j ..
// 4j + 3) of a group's block is 32 bytes, byte 4o + i = output o at k = 4j + i, and a row's 4 values at those k
// are broadcast against it, so vpmaddubsw's int16 lanes 2o and 2o + 1 hold output o's products and vpmaddwd
// (with ones) gives output o's sum in int32 lane o: no horizontal sums. int4 (unsigned 0..15, vpmaddubsw's
// unsigned operand as they are; a nibble of a 32-byte load is a whole quad, so a load, a shift and two ANDs
// unpack 64 weights): each int16 lane sums 16 products of a block, |sum| <= 16 x 15 x 127 < 2^15, so the
// block's 8 quads add up in int16 without overflow and one vpmaddwd a block widens them; int8 (up to 128 x 127 a product; |w| times x with w's sign): each quad widened to int32 at once. Every tile shape runs the same
// sequence for each (row, output), so which shapes a call uses changes no bit.
template <int BITS, int NG, int TR>
AVX2_FMA void tile(const Packed& W, int64_t g0, const QuantRows& X, int64_t T, int64_t t0, float* out, int64_t ldo) {
  constexpr int64_t BB = block_bytes<BITS>();
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[TR][NG];
#pragma GCC unroll 8
  for (int t = 0; t < TR; t++)
#pragma GCC unroll 8
    for (int g = 0; g < NG; g++) acc[t][g] = _mm256_setzero_ps();
  for (int64_t b = 0; b < W.nblocks; b++) {
    const int8_t* xq = X.q.data() + (b * T + t0) * BLOCK;
    const float* xd = X.d.data() + b * T + t0;
    const float* xs = X.s.data() + b * T + t0;
    const uint8_t* blk[NG];
#pragma GCC unroll 8
    for (int g = 0; g < NG; g++) {
      blk[g] = W.data + ((g0 + g) * W.nblocks + b) * BB;
      // PREFETCH_BLOCKS ahead in the group's stream; near its end, the start of the next tile's group in the
      // same place (each tile's first blocks would otherwise wait on DRAM)
      const uint8_t* next = blk[g] + (b + PREFETCH_BLOCKS < W.nblocks ? PREFETCH_BLOCKS
                                                                       : PREFETCH_BLOCKS + (NG - 1) * W.nblocks) * BB;
      for (int64_t line = 0; line < BB; line += 64) _mm_prefetch((const char*)(next + line), _MM_HINT_T0);
    }
    // int4: int16 sums of the block, lanes 2o and 2o + 1 output o's; int8: int32 sums, lane o output o's
    __m256i sum[TR][NG];
#pragma GCC unroll 8
    for (int t = 0; t < TR; t++)
#pragma GCC unroll 8
      for (int g = 0; g < NG; g++) sum[t][g] = _mm256_setzero_si256();
    if constexpr (TR == 1) {
      // one row: group by group, one chain of adds each (few registers live; the groups' chains are
      // independent for the core to overlap), the row's broadcast values shared by every group
      const int32_t* xr = reinterpret_cast<const int32_t*>(xq);
#pragma GCC unroll 8
      for (int g = 0; g < NG; g++) {
        __m256i s = _mm256_setzero_si256();
        if constexpr (BITS == 4) {
          const __m256i low = _mm256_set1_epi8(0x0F);
#pragma GCC unroll 4
          for (int p = 0; p < BLOCK / 8; p++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i*)(blk[g] + p * 32));
            s = _mm256_add_epi16(s, _mm256_maddubs_epi16(_mm256_and_si256(raw, low), _mm256_set1_epi32(xr[2 * p])));
            s = _mm256_add_epi16(s, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low),
                                                         _mm256_set1_epi32(xr[2 * p + 1])));
            // keeps the chain in order: without it GCC reassociates the adds, computes every product of the
            // tile first and spills them to the stack
            asm("" : "+x"(s));
          }
        } else {
#pragma GCC unroll 8
          for (int j = 0; j < BLOCK / 4; j++) {
            const __m256i w = _mm256_loadu_si256((const __m256i*)(blk[g] + j * 32));
            const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(_mm256_set1_epi32(xr[j]), w));
            s = _mm256_add_epi32(s, _mm256_madd_epi16(p, ones));
            asm("" : "+x"(s));
          }
        }
        sum[0][g] = s;
      }
    } else if constexpr (BITS == 4) {
      // quads 2p (low nibbles) and 2p + 1 (high nibbles) in one 32-byte load, unpacked once for every row;
      // the row's values at k = 8p .. 8p + 3 broadcast against the first, 8p + 4 .. 8p + 7 against the second
      const __m256i low = _mm256_set1_epi8(0x0F);
#pragma GCC unroll 4
      for (int p = 0; p < BLOCK / 8; p++) {
        __m256i w0[NG], w1[NG];
#pragma GCC unroll 8
        for (int g = 0; g < NG; g++) {
          const __m256i raw = _mm256_loadu_si256((const __m256i*)(blk[g] + p * 32));
          w0[g] = _mm256_and_si256(raw, low);
          w1[g] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
        }
#pragma GCC unroll 8
        for (int t = 0; t < TR; t++) {
          const __m256i x0 = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(xq + t * BLOCK + 8 * p));
          const __m256i x1 = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(xq + t * BLOCK + 8 * p + 4));
#pragma GCC unroll 8
          for (int g = 0; g < NG; g++)
            sum[t][g] = _mm256_add_epi16(sum[t][g], _mm256_add_epi16(_mm256_maddubs_epi16(w0[g], x0),
                                                                     _mm256_maddubs_epi16(w1[g], x1)));
        }
      }
    } else {
#pragma GCC unroll 8
      for (int j = 0; j < BLOCK / 4; j++) {
        __m256i w[NG], wabs[NG];
#pragma GCC unroll 8
        for (int g = 0; g < NG; g++) {
          w[g] = _mm256_loadu_si256((const __m256i*)(blk[g] + j * 32));
          wabs[g] = _mm256_sign_epi8(w[g], w[g]);
        }
#pragma GCC unroll 8
        for (int t = 0; t < TR; t++) {
          const __m256i xv = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(xq + t * BLOCK + 4 * j));
#pragma GCC unroll 8
          for (int g = 0; g < NG; g++) {
            const __m256i p = _mm256_maddubs_epi16(wabs[g], _mm256_sign_epi8(xv, w[g]));
            sum[t][g] = _mm256_add_epi32(sum[t][g], _mm256_madd_epi16(p, ones));
          }
        }
      }
    }
#pragma GCC unroll 8
    for (int g = 0; g < NG; g++) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk[g] + quant_bytes<BITS>())));
      const __m256 m = BITS == 4 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk[g] + quant_bytes<BITS>() + 16)))
                                 : _mm256_setzero_ps();
#pragma GCC unroll 8
      for (int t = 0; t < TR; t++) {
        const __m256i S = BITS == 4 ? _mm256_madd_epi16(sum[t][g], ones) : sum[t][g];
        acc[t][g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S), _mm256_mul_ps(d, _mm256_broadcast_ss(xd + t)), acc[t][g]);
        if constexpr (BITS == 4) acc[t][g] = _mm256_fmadd_ps(m, _mm256_broadcast_ss(xs + t), acc[t][g]);
      }
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < TR; t++)
#pragma GCC unroll 8
    for (int g = 0; g < NG; g++) store_group(W, g0 + g, out + (t0 + t) * ldo, acc[t][g]);
}

// Rows [t0, t0 + TR) against groups [c, c_end): NG at a time, then one at a time.
template <int BITS, int NG, int TR>
AVX2_FMA void rows(const Packed& W, int64_t c, int64_t c_end, const QuantRows& X, int64_t T, int64_t t0, float* out,
                   int64_t ldo) {
  int64_t g = c;
  for (; g + NG <= c_end; g += NG) tile<BITS, NG, TR>(W, g, X, T, t0, out, ldo);
  for (; g < c_end; g++) tile<BITS, 1, TR>(W, g, X, T, t0, out, ldo);
}

template <int BITS>
AVX2_FMA void gemm(const Packed& W, const QuantRows& X, int64_t T, float* out, int64_t ldo) {
  torch::stable::parallel_for(0, W.groups, CHUNK_GROUPS, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; c += CHUNK_GROUPS) {
      const int64_t c_end = std::min(c + CHUNK_GROUPS, end);
      // tiles of rows x groups: enough running sums in flight (the fma chain's latency), a quad's weights
      // unpacked once for every row of the tile, within the 16 ymm registers; the chunk's weights stay in cache
      // while every row tile passes over them
      int64_t t0 = 0;
      for (; t0 + 4 <= T; t0 += 4) rows<BITS, 1, 4>(W, c, c_end, X, T, t0, out, ldo);
      if (T - t0 == 3) rows<BITS, 1, 3>(W, c, c_end, X, T, t0, out, ldo);
      else if (T - t0 == 2) rows<BITS, BITS == 4 ? 1 : 2, 2>(W, c, c_end, X, T, t0, out, ldo);
      else if (T - t0 == 1) rows<BITS, BITS == 4 ? 4 : 8, 1>(W, c, c_end, X, T, t0, out, ldo);
    }
  });
}

// x: T rows of K = W.nblocks * 32 floats (row stride ldx) -> out [T, W.n] (row stride ldo); X is scratch,
// resized here (reused across calls, it saves the allocations).
AVX2_FMA inline void linear(const Packed& W, int bits, const float* x, int64_t ldx, int64_t T, QuantRows& X, float* out,
                            int64_t ldo) {
  const size_t n = static_cast<size_t>(T * W.nblocks);
  if (X.d.size() < n) X.q.resize(n * BLOCK), X.d.resize(n), X.s.resize(n);
  quantize_rows(x, ldx, T, W.nblocks, X.q.data(), X.d.data(), X.s.data());
  if (bits == 4) gemm<4>(W, X, T, out, ldo);
  else gemm<8>(W, X, T, out, ldo);
}

}  // namespace i8
