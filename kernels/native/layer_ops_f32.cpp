// A decoder layer's elementwise work for float32 CPU tensors, for CPUs with AVX2 + FMA: the ops of
// layer_ops.cpp (bf16) with the same semantics (kernels/__init__.py dispatches here; kernels/reference.py is
// the oracle):
//   add_rms_norm(x, residual?, weight, eps) -> (norm(x + residual) * weight, x + residual)
//   silu_and_mul(x [T, 2I], torch_block) -> silu(gate) * up [T, I]
//   rotary_and_write_kv(positions, q, k, v, cos_sin, k_cache, v_cache, slots): rotates q and k in place
//     (neox rotate-half) and stores the rotated k and v at their cache slots (slots < 0 skipped); returns
//     false, doing nothing, for dtypes and layouts it does not take (the caller runs torch)
//   argmax(logits [R, V]) -> int64 [R]: torch.argmax(logits, dim=-1)
//
// Bit-identical to the torch reference, so an fp32 model's layers give the same values natively as with
// torch: the same separate fp32 operations in the same order (no FMA contraction: see the pragma), the rms
// statistic summed in the order of torch's vectorized CPU sum (avx2_math.h), silu's exp as torch computes
// it: Sleef's expf_u10 in its vector loop and the C library's expf for the elements past the loop's last
// whole step of `torch_block` floats (2 vectors of torch's CPU capability: the caller passes it).
// tests/test_native_layer_ops_f32.py checks equality. Rows are independent and a row's arithmetic never
// depends on the batch or the thread count.
//
// Built against torch's stable ABI (torch/csrc/stable). Registered as torch.ops.phaseserve_layer_ops_f32.

#pragma GCC optimize("fp-contract=off")  // torch rounds a*b and the sum separately: never fuse to an FMA

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/util/Exception.h>

#include <immintrin.h>

#include "avx2_math.h"
#include "layer_ops_f32.h"
#include "op_args.h"
#include "row_tensors.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

using torch::stable::Tensor;
using torch::headeronly::ScalarType;
using namespace f32_rows;

constexpr int64_t ELEMS_PER_THREAD = 32768;  // below this much work a call stays on the calling thread
constexpr const char* LEVEL = "AVX2 and FMA";  // what the ops need, as their errors say it

// ------------------------------------------------------------------------------------------------ rms norm

std::tuple<Tensor, Tensor> add_rms_norm_impl(Tensor x, Tensor* residual, Tensor weight, double eps) {
  op_args::check_cpu(cpu_supports_avx2_fma(), "add_rms_norm", LEVEL);
  const int64_t n = op_args::check_norm_args(x, residual, weight, op_args::F32);
  if (weight.stride(0) != 1) weight = torch::stable::contiguous(weight);
  const int64_t xs = as_rows(x);
  const int64_t rs = residual != nullptr ? as_rows(*residual) : 0;
  Tensor out = empty(shape_of(x), aoti_torch_dtype_float32());
  Tensor h = residual != nullptr ? empty(shape_of(x), aoti_torch_dtype_float32()) : out;
  const int64_t rows = rows_of(x);
  if (rows == 0 || n == 0) return {out, h};
  const float* xp = x.const_data_ptr<float>();
  const float* rp = residual != nullptr ? residual->const_data_ptr<float>() : nullptr;
  const float* wp = weight.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  float* hp = h.mutable_data_ptr<float>();
  const float feps = static_cast<float>(eps);
  torch::stable::parallel_for(0, rows, std::max<int64_t>(1, ELEMS_PER_THREAD / n), [&](int64_t begin, int64_t end) {
    std::vector<float> sq(n);
    for (int64_t i = begin; i < end; i++)
      rms_norm_row(xp + i * xs, rp != nullptr ? rp + i * rs : nullptr, wp, hp + i * n, op + i * n, n, feps,
                   sq.data());
  });
  return {out, h};
}

Tensor rms_norm(Tensor x, Tensor weight, double eps) { return std::get<0>(add_rms_norm_impl(x, nullptr, weight, eps)); }

std::tuple<Tensor, Tensor> add_rms_norm(Tensor x, Tensor residual, Tensor weight, double eps) {
  return add_rms_norm_impl(x, &residual, weight, eps);
}

// ------------------------------------------------------------------------------------------------ silu * up

// torch_block: floats per step of torch's vectorized loop (32 for its AVX512 kernels, 16 for AVX2; 0: torch
// computes every exp with the C library's expf).
Tensor silu_and_mul(Tensor x, int64_t torch_block) {
  op_args::check_cpu(cpu_supports_avx2_fma(), "silu_and_mul", LEVEL);
  const int64_t width = op_args::check_silu_args(x, op_args::F32);
  STD_TORCH_CHECK(torch_block >= 0 && torch_block % 8 == 0, "silu_and_mul: torch_block must be a multiple of 8");
  const int64_t xs = as_rows(x);
  const int64_t inter = width / 2, rows = rows_of(x);
  std::vector<int64_t> shape = shape_of(x);
  shape.back() = inter;
  Tensor out = empty(shape, aoti_torch_dtype_float32());
  if (rows == 0 || inter == 0) return out;
  const int64_t vector_end = torch_block == 0 ? 0 : inter / torch_block * torch_block;
  const float* xp = x.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  torch::stable::parallel_for(0, rows, std::max<int64_t>(1, ELEMS_PER_THREAD / inter), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i++) silu_and_mul_row(xp + i * xs, op + i * inter, inter, vector_end);
  });
  return out;
}

// ------------------------------------------------------------------------------------------------ rotary + KV

template <typename Index>
void rotate_and_write(const Index* pos, const Index* slot, const Tensor& q, const Tensor& k, const Tensor& v,
                      const Tensor& cos_sin, const Tensor& k_cache, const Tensor& v_cache) {
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(1);
  const int64_t half = cos_sin.size(1) / 2, max_pos = cos_sin.size(0);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  op_args::check_rotary_indices(pos, slot, T, max_pos, num_slots);
  float* qp = q.mutable_data_ptr<float>();
  float* kp = k.mutable_data_ptr<float>();
  const float* vp = v.const_data_ptr<float>();
  float* kc = k_cache.mutable_data_ptr<float>();
  float* vc = v_cache.mutable_data_ptr<float>();
  const float* cs = cos_sin.const_data_ptr<float>();
  const int64_t cs_stride = cos_sin.stride(0);
  const int64_t qst = q.stride(0), qsh = q.stride(1), kst = k.stride(0), ksh = k.stride(1);
  const int64_t vst = v.stride(0), vsh = v.stride(1);
  const int64_t per_token = (H + 2 * KVH) * D;
  torch::stable::parallel_for(0, T, std::max<int64_t>(1, ELEMS_PER_THREAD / per_token), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; t++) {
      rotate_and_store_token(qp + t * qst, qsh, H, kp + t * kst, ksh, vp + t * vst, vsh, KVH, D,
                             cs + static_cast<int64_t>(pos[t]) * cs_stride, half, slot[t], kc, vc);
    }
  });
}

// false (nothing done) for dtypes and layouts the op does not take (op_args::rotary_args_taken): the caller then
// runs torch. Shapes that disagree or indices out of range are errors.
bool rotary_and_write_kv(Tensor positions, Tensor q, Tensor k, Tensor v, Tensor cos_sin, Tensor k_cache,
                         Tensor v_cache, Tensor slots) {
  op_args::check_cpu(cpu_supports_avx2_fma(), "rotary_and_write_kv", LEVEL);
  if (!op_args::rotary_args_taken(positions, q, k, v, cos_sin, k_cache, v_cache, slots, op_args::F32))
    return false;
  if (q.size(0) == 0) return true;
  const auto index_type = positions.scalar_type();
  if (index_type == ScalarType::Long)
    rotate_and_write(positions.const_data_ptr<int64_t>(), slots.const_data_ptr<int64_t>(), q, k, v, cos_sin,
                     k_cache, v_cache);
  else
    rotate_and_write(positions.const_data_ptr<int32_t>(), slots.const_data_ptr<int32_t>(), q, k, v, cos_sin,
                     k_cache, v_cache);
  return true;
}

// ------------------------------------------------------------------------------------------------ argmax

// The first index of the row's maximum, as torch's argmax finds it: a NaN is the maximum (the first NaN
// wins), equal values (+0 and -0 too) go to the lowest index. Four accumulators of 8 lanes, each seeing its
// indices in increasing order and keeping its first maximum on a strict >; the lowest index among the lanes
// holding the overall maximum is then the row's first.
AVX2_FMA int64_t argmax_row(const float* x, int64_t n) {
  constexpr int ACC = 4;
  __m256 best[ACC];
  __m256i at[ACC];
  for (int a = 0; a < ACC; a++) {
    best[a] = _mm256_set1_ps(-INFINITY);
    at[a] = _mm256_set1_epi32(INT32_MAX);  // a lane that never sees a value above -inf never wins below
  }
  __m256 nan = _mm256_setzero_ps();
  __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i step = _mm256_set1_epi32(8);
  int64_t c = 0;
  for (; c + 8 * ACC <= n; c += 8 * ACC) {
    for (int a = 0; a < ACC; a++) {
      const __m256 v = _mm256_loadu_ps(x + c + 8 * a);
      const __m256 gt = _mm256_cmp_ps(v, best[a], _CMP_GT_OQ);
      best[a] = _mm256_blendv_ps(best[a], v, gt);
      at[a] = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(at[a]), _mm256_castsi256_ps(idx), gt));
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      idx = _mm256_add_epi32(idx, step);
    }
  }
  float top = -INFINITY;
  int64_t top_at = INT64_MAX;
  bool tail_nan = false;
  for (; c < n; c++) {  // the tail, one by one
    tail_nan |= std::isnan(x[c]);
    if (x[c] > top) top = x[c], top_at = c;
  }
  if (tail_nan || _mm256_movemask_ps(nan) != 0) {  // rare: the first NaN
    for (int64_t i = 0; i < n; i++)
      if (std::isnan(x[i])) return i;
  }
  alignas(32) float b[ACC][8];
  alignas(32) int32_t i[ACC][8];
  for (int a = 0; a < ACC; a++) {
    _mm256_store_ps(b[a], best[a]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(i[a]), at[a]);
  }
  for (int a = 0; a < ACC; a++)
    for (int l = 0; l < 8; l++)
      if (i[a][l] != INT32_MAX && (b[a][l] > top || (b[a][l] == top && i[a][l] < top_at))) top = b[a][l], top_at = i[a][l];
  return top_at == INT64_MAX ? 0 : top_at;  // every value -inf: torch returns the first
}

Tensor argmax(Tensor logits) {
  op_args::check_cpu(cpu_supports_avx2_fma(), "argmax", LEVEL);
  op_args::check_argmax_args(logits, op_args::F32);
  const int64_t rows = logits.size(0), n = logits.size(1);
  const int64_t stride = as_rows(logits);
  Tensor out = empty({rows}, aoti_torch_dtype_int64());
  if (rows == 0) return out;
  const float* xp = logits.const_data_ptr<float>();
  auto* op = out.mutable_data_ptr<int64_t>();
  torch::stable::parallel_for(0, rows, std::max<int64_t>(1, ELEMS_PER_THREAD / n), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i++) op[i] = argmax_row(xp + i * stride, n);
  });
  return out;
}

bool supported() { return cpu_supports_avx2_fma(); }

}  // namespace

PHASESERVE_LAYER_OPS_LIBRARY(phaseserve_layer_ops_f32, "silu_and_mul(Tensor x, int torch_block) -> Tensor")
