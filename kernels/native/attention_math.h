// The arithmetic the native bf16 attention ops share (decode_attention.cpp, extend_attention.cpp), one copy,
// so that a query row (one query head at one position) gets the same bits from either op:
// - keys are cut into partitions of PARTITION_TOKENS at absolute positions (0, 512, ...);
// - a score is one vdpbf16ps chain over the feature pairs in order (keys in lanes, K transposed into
//   feature pairs: transpose16x16), times scale * log2(e);
// - a partition's softmax (softmax_row): the max of the row's visible scores, p = 2^(s - max) rounded to
//   bf16, their sum as 16 lanes over the keys' 16-key tiles in order, then one fixed reduction;
// - acc = p.V as one vdpbf16ps chain per feature over the key pairs in order, from 0 at the partition start;
// - partitions folded in order into (max, sum, acc) (fold_partition); the output is bf16(acc / sum).
// The ops' files are compiled with fp-contract off, so only the FMAs written out fuse.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

constexpr int64_t PARTITION_TOKENS = 512;  // a multiple of 128

#include "cpu_features.h"

// 2^x for x <= 0 (clamped below at -126: the result is then ~0 and the caller masks what must be 0).
AVX512_BF16 inline __m512 exp2_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
  __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_sub_ps(x, n);  // [-0.5, 0.5]
  // 2^f = e^(f ln2), Taylor to degree 6 (relative error < 2e-7 on [-0.5, 0.5])
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129107628477e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550410866482158e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24022650695910072f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931471805599453f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// out[h] = bf16(acc[h] / l[h]) for D elements. With bf16 p.V the accumulators hold each 32 features as
// unpacklo/unpackhi left them (lane 4j+k: feature 8j+k, then 8j+4+k): put back in order here.
AVX512_BF16 inline void store_normalized(uint16_t* out, const float* acc, float inv_l, int64_t d) {
  const __m512 s = _mm512_set1_ps(inv_l);
  const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t c = 0; c < d; c += 32) {
    const __m512 x = _mm512_mul_ps(_mm512_load_ps(acc + c), s), y = _mm512_mul_ps(_mm512_load_ps(acc + c + 16), s);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c), (__m256i)_mm512_cvtneps_pbh(_mm512_permutex2var_ps(x, lo, y)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c + 16),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_permutex2var_ps(x, hi, y)));
  }
}

// 16 rows of 16 dwords -> 16 columns, in place (three rounds: 32-bit, 64-bit, 128-bit interleaves). On 16
// keys' rows of 32 bf16 features: r[j] = feature pair j of the 16 keys (key t in lane t).
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

// One step of a score or p.V chain: acc + a . b over each lane's bf16 pair, `a` the broadcast pair (a
// query's features, or a row's probabilities). Both ops call this, so the operands' order is one.
AVX512_BF16 inline __m512 dot_pair(__m512 acc, int32_t a_pair, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(a_pair), (__m512bh)b);
}

AVX512_BF16 inline int32_t bf16_pair(const uint16_t* x) {
  int32_t pair;
  std::memcpy(&pair, x, sizeof(pair));
  return pair;
}

// Softmax of one row over the `visible` (1..PARTITION_TOKENS) keys of a partition: s holds the raw scores
// (q . k), 16-key tiles in order. Writes p = 2^(s * scale_log2 - max) as bf16 for the row's 16-key tiles
// (0 past visible); returns the max, and the sum of p in *l.
AVX512_BF16 inline float softmax_row(const float* s, int64_t visible, float scale_log2, uint16_t* probs, float* l) {
  const int64_t tiles = (visible + 15) / 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (visible - (tiles - 1) * 16)) - 1);
  const __m512 sc = _mm512_set1_ps(scale_log2);
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j + 1 < tiles; j++) mx = _mm512_max_ps(mx, _mm512_mul_ps(_mm512_loadu_ps(s + j * 16), sc));
  mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_mul_ps(_mm512_loadu_ps(s + (tiles - 1) * 16), sc));
  const float m = _mm512_reduce_max_ps(mx);
  const __m512 mv = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < tiles; j++) {
    __m512 p = exp2_ps(_mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(s + j * 16), sc), mv));
    if (j + 1 == tiles) p = _mm512_maskz_mov_ps(tail, p);
    sum = _mm512_add_ps(sum, p);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + j * 16), (__m256i)_mm512_cvtneps_pbh(p));
  }
  *l = _mm512_reduce_add_ps(sum);
  return m;
}

// Fold a partition's (acc [d], m, l) of one row into the row's running (o [d], mo, lo), partitions in order;
// start from o = 0, mo = -inf, lo = 0.
AVX512_BF16 inline void fold_partition(const float* acc, float m, float l, float* o, float* mo, float* lo, int64_t d) {
  const float m_new = std::fmax(*mo, m);
  const float keep = std::exp2(*mo - m_new), w = std::exp2(m - m_new);  // keep = 0 on the first partition
  *lo = std::fmaf(l, w, *lo * keep);
  *mo = m_new;
  const __m512 kv = _mm512_set1_ps(keep), wv = _mm512_set1_ps(w);
  for (int64_t c = 0; c < d; c += 16)
    _mm512_storeu_ps(o + c, _mm512_fmadd_ps(_mm512_loadu_ps(acc + c), wv, _mm512_mul_ps(_mm512_loadu_ps(o + c), kv)));
}
