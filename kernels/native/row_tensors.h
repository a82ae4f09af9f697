// Tensor plumbing the row-wise layer ops share (layer_ops.cpp for bf16, layer_ops_f32.cpp for float32): new
// outputs without the dispatcher's per-call cost, and inputs seen as rows of one stride.
#pragma once

#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <vector>

// A new dense CPU tensor of `dtype` (aoti_torch_dtype_*). aoti_torch_empty_strided calls at::empty_strided
// directly; the stable new_empty goes through the boxed dispatcher by op name, a cost a small op
// notices.
inline torch::stable::Tensor empty(const std::vector<int64_t>& shape, int32_t dtype) {
  std::vector<int64_t> strides(shape.size());
  int64_t stride = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = stride;
    stride *= shape[i];
  }
  AtenTensorHandle handle = nullptr;
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(static_cast<int64_t>(shape.size()), shape.data(),
                                                         strides.data(), dtype, aoti_torch_device_type_cpu(), 0,
                                                         &handle));
  return torch::stable::Tensor(handle);
}

// t's leading dims as rows of one stride (returned), the last dim dense: t itself when it is laid out so
// (a GEMM output, or a slice of rows of one), else a contiguous copy.
inline int64_t as_rows(torch::stable::Tensor& t) {
  const int64_t d = t.dim();
  bool rows = t.stride(d - 1) == 1 || t.size(d - 1) == 1;
  for (int64_t i = d - 3; i >= 0 && rows; i--)
    rows = t.size(i + 1) == 1 || t.stride(i) == t.stride(i + 1) * t.size(i + 1);
  if (!rows) t = torch::stable::contiguous(t);
  return d >= 2 ? t.stride(d - 2) : t.size(d - 1);
}

inline int64_t rows_of(const torch::stable::Tensor& t) {
  int64_t rows = 1;
  for (int64_t i = 0; i + 1 < t.dim(); i++) rows *= t.size(i);
  return rows;
}

// The shape of t, for an output like it.
inline std::vector<int64_t> shape_of(const torch::stable::Tensor& t) {
  std::vector<int64_t> shape(t.dim());
  for (int64_t i = 0; i < t.dim(); i++) shape[i] = t.size(i);
  return shape;
}
