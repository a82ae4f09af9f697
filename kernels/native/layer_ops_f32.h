// The row kernels of layer_ops_f32.cpp (rms norm, silu * up, rotary + KV store of one token), in a header so
// that the fused decode layer (decode_layer_f32.cpp) runs the very same code: one copy of the arithmetic.
// layer_ops_f32.cpp says the numerics (torch's bits: separate fp32 operations, no FMA contraction).
#pragma once

#include <immintrin.h>

#include "avx2_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")  // torch rounds a*b and the sum separately: never fuse to an FMA

namespace f32_rows {

// One row: h = x + r (when r), then out = w * (h * (1 / sqrt(sum(h^2) / n + eps))). sq: n floats of scratch.
AVX2_FMA inline void rms_norm_row(const float* x, const float* r, const float* w, float* h_out, float* out, int64_t n,
                           float eps, float* sq) {
  const float* h = r != nullptr ? h_out : x;
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) {
    __m256 v = _mm256_loadu_ps(x + c);
    if (r != nullptr) {
      v = _mm256_add_ps(v, _mm256_loadu_ps(r + c));
      _mm256_storeu_ps(h_out + c, v);
    }
    _mm256_storeu_ps(sq + c, _mm256_mul_ps(v, v));
  }
  for (; c < n; c++) {
    const float v = r != nullptr ? (h_out[c] = x[c] + r[c]) : x[c];
    sq[c] = v * v;
  }
  // torch: sum(h^2).div_(n).add_(eps), then rsqrt as 1 / sqrt
  const float mean = torch_order_sum(sq, n) / static_cast<float>(n);
  const float inv = 1.0f / std::sqrt(mean + eps);
  const __m256 iv = _mm256_set1_ps(inv);
  for (c = 0; c + 8 <= n; c += 8)
    _mm256_storeu_ps(out + c, _mm256_mul_ps(_mm256_loadu_ps(w + c), _mm256_mul_ps(_mm256_loadu_ps(h + c), iv)));
  for (; c < n; c++) out[c] = w[c] * (h[c] * inv);
}

// One row: out = silu(gate) * up, silu(g) = g / (1 + exp(-g)); exp as torch's loop computes it (see the top).
AVX2_FMA inline void silu_and_mul_row(const float* x, float* out, int64_t inter, int64_t vector_end) {
  const float* up = x + inter;
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  int64_t c = 0;
  for (; c < vector_end; c += 8) {
    const __m256 g = _mm256_loadu_ps(x + c);
    const __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, sleef_expf(_mm256_xor_ps(g, sign))));
    _mm256_storeu_ps(out + c, _mm256_mul_ps(s, _mm256_loadu_ps(up + c)));
  }
  for (; c < inter; c++) out[c] = x[c] / (1.0f + std::exp(-x[c])) * up[c];
}

// Rotates the first 2 * half features of each of the token's heads in place: (x1, x2) -> (x1 c - x2 s,
// x2 c + x1 s), each product rounded on its own, as the reference does.
AVX2_FMA inline void rotate_heads(float* base, int64_t sh, int64_t heads, const float* cos, const float* sin,
                                  int64_t half) {
  for (int64_t h = 0; h < heads; h++) {
    float* x = base + h * sh;
    int64_t c = 0;
    for (; c + 8 <= half; c += 8) {
      const __m256 x1 = _mm256_loadu_ps(x + c), x2 = _mm256_loadu_ps(x + half + c);
      const __m256 cv = _mm256_loadu_ps(cos + c), sv = _mm256_loadu_ps(sin + c);
      _mm256_storeu_ps(x + c, _mm256_sub_ps(_mm256_mul_ps(x1, cv), _mm256_mul_ps(x2, sv)));
      _mm256_storeu_ps(x + half + c, _mm256_add_ps(_mm256_mul_ps(x2, cv), _mm256_mul_ps(x1, sv)));
    }
    for (; c < half; c++) {
      const float x1 = x[c], x2 = x[half + c];
      x[c] = x1 * cos[c] - x2 * sin[c];
      x[half + c] = x2 * cos[c] + x1 * sin[c];
    }
  }
}

inline void copy_heads(float* dst, const float* src, int64_t src_sh, int64_t heads, int64_t d) {
  for (int64_t h = 0; h < heads; h++) std::copy(src + h * src_sh, src + h * src_sh + d, dst + h * d);
}

// Token t of rotary_and_write_kv: its q heads (H, head stride qsh) and k heads (KVH, ksh) rotated in place by
// the position's cos/sin (cos[0, half), sin right after), then, when slot >= 0, its rotated k and its v stored
// at that slot of the caches ([slots, KVH, D] dense).
AVX2_FMA inline void rotate_and_store_token(float* q, int64_t qsh, int64_t H, float* k, int64_t ksh, const float* v,
                                            int64_t vsh, int64_t KVH, int64_t D, const float* cos, int64_t half,
                                            int64_t slot, float* k_cache, float* v_cache) {
  rotate_heads(q, qsh, H, cos, cos + half, half);
  rotate_heads(k, ksh, KVH, cos, cos + half, half);
  if (slot >= 0) {
    copy_heads(k_cache + slot * KVH * D, k, ksh, KVH, D);
    copy_heads(v_cache + slot * KVH * D, v, vsh, KVH, D);
  }
}

}  // namespace f32_rows

#pragma GCC pop_options
