// y = x @ W^T for a block-quantized W with the float32 activations quantized to int8 first, for CPUs with
// AVX2 + FMA: the op around the kernels of quant_gemm_i8.h (which says the layout and the numerics).
//
// Built against torch's stable ABI. Registered as torch.ops.phaseserve_quant_gemm_i8.{quant_linear,
// quantize_activations, supported}.

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/util/Exception.h>

#include "op_args.h"
#include "quant_gemm_i8.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

using torch::stable::Tensor;
using torch::headeronly::ScalarType;
using namespace i8;

void check_x(const char* name, const Tensor& x) {
  op_args::check_cpu(cpu_supports_avx2_fma(), name, "AVX2 + FMA");
  op_args::check_activations(x, op_args::F32, name);
  STD_TORCH_CHECK(x.size(1) % BLOCK == 0, name, ": K = ", x.size(1), " is not a multiple of ", BLOCK);
}

QuantRows quantized(const Tensor& x) {
  const int64_t T = x.size(0), nblocks = x.size(1) / BLOCK;
  QuantRows X{std::vector<int8_t>(T * nblocks * BLOCK), std::vector<float>(T * nblocks),
              std::vector<float>(T * nblocks)};
  quantize_rows(static_cast<const float*>(x.const_data_ptr()), x.stride(0), T, nblocks, X.q.data(), X.d.data(),
                X.s.data());
  return X;
}

// x [T, K] float32 (dense rows); packed uint8 [ceil(N / 8), K / 32, block bytes] as kernels/native_quant_i8.py
// packs it; returns [T, N] float32.
Tensor quant_linear(Tensor x, Tensor packed, int64_t bits, int64_t n) {
  check_x("quant_linear", x);
  op_args::check_bits(bits, "quant_linear");
  const int64_t T = x.size(0), K = x.size(1);
  op_args::check_packed(packed, bits == 4 ? block_bytes<4>() : block_bytes<8>(), "ceil(N / 8)", K, BLOCK,
                        "quant_linear");
  const int64_t groups = packed.size(0), nblocks = packed.size(1);
  op_args::check_outputs(n, groups, LANES, "quant_linear");
  Tensor out = torch::stable::new_empty(x, {T, n});
  if (T == 0 || n == 0) return out;
  const QuantRows X = quantized(x);
  Packed W{static_cast<const uint8_t*>(packed.const_data_ptr()), nblocks, groups, n};
  float* o = static_cast<float*>(out.mutable_data_ptr());
  if (bits == 4) gemm<4>(W, X, T, o, n);
  else gemm<8>(W, X, T, o, n);
  return out;
}

// The activation quantization alone (for its test against the torch reference): x [T, K] float32 -> q int8
// [T, K], d and s float32 [T, K / 32] written in place.
void quantize_activations(Tensor x, Tensor q, Tensor d, Tensor s) {
  check_x("quantize_activations", x);
  const int64_t T = x.size(0), K = x.size(1), nblocks = K / BLOCK;
  STD_TORCH_CHECK(q.is_contiguous() && q.scalar_type() == ScalarType::Char && q.numel() == T * K &&
                      d.is_contiguous() && d.scalar_type() == ScalarType::Float && d.numel() == T * nblocks &&
                      s.is_contiguous() && s.scalar_type() == ScalarType::Float && s.numel() == T * nblocks,
                  "quantize_activations: q must be contiguous int8 [T, K], d and s float32 [T, K / 32]");
  const QuantRows X = quantized(x);
  int8_t* qp = static_cast<int8_t*>(q.mutable_data_ptr());
  float* dp = static_cast<float*>(d.mutable_data_ptr());
  float* sp = static_cast<float*>(s.mutable_data_ptr());
  for (int64_t t = 0; t < T; t++)
    for (int64_t b = 0; b < nblocks; b++) {
      std::copy_n(X.q.data() + (b * T + t) * BLOCK, BLOCK, qp + t * K + b * BLOCK);
      dp[t * nblocks + b] = X.d[b * T + t];
      sp[t * nblocks + b] = X.s[b * T + t];
    }
}

bool supported() { return cpu_supports_avx2_fma(); }

}  // namespace

STABLE_TORCH_LIBRARY(phaseserve_quant_gemm_i8, m) {
  m.def("quant_linear(Tensor x, Tensor packed, int bits, int n) -> Tensor");
  m.def("quantize_activations(Tensor x, Tensor(a!) q, Tensor(b!) d, Tensor(c!) s) -> ()");
  m.def("supported() -> bool");
}

STABLE_TORCH_LIBRARY_IMPL(phaseserve_quant_gemm_i8, CPU, m) {
  m.impl("quant_linear", TORCH_BOX(&quant_linear));
  m.impl("quantize_activations", TORCH_BOX(&quantize_activations));
}

PHASESERVE_SUPPORTED_IMPL(phaseserve_quant_gemm_i8)
