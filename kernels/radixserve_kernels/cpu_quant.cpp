// FP8 (float8_e4m3fn) weights on CPU, weight-only: y = x W^T with W held as one byte a weight
// and a float32 scale per `group` input columns of each output row. For the few rows of a decode
// step each thread takes a range of output rows, widens one row of W at a time into a float
// buffer (scaled, in L1) and dots it with every row of x, so that W streams from memory once per
// call at a quarter of float32's bytes. Prefill-sized calls widen W once (`fp8_dequantize`) and
// run a float32 GEMM (the caller's choice, radixserve/quant/weights.py).
#include <torch/extension.h>
#include "cpu_bindings.h"
#include <ATen/Parallel.h>
#include <cstring>
#include <vector>
#include "cpu_quant.h"

namespace {

void check_fp8(const torch::Tensor& data, const torch::Tensor& scales, int64_t group) {
  TORCH_CHECK(data.dim() == 2 && data.scalar_type() == torch::kByte && data.is_contiguous(),
              "fp8 weight must be contiguous [out, in] uint8");
  TORCH_CHECK(group > 0 && scales.dim() == 2 && scales.scalar_type() == torch::kFloat && scales.is_contiguous() &&
                  scales.size(0) == data.size(0) && scales.size(1) == (data.size(1) + group - 1) / group,
              "fp8 scales must be contiguous [out, ceil(in / group)] float32");
}

// Row n of W as floats, each group times its scale.
inline void widen_row(const uint8_t* row, const float* scales, int64_t k, int64_t group, float* out) {
  for (int64_t g0 = 0, gi = 0; g0 < k; g0 += group, ++gi) {
    const int64_t g1 = std::min(k, g0 + group);
    const float s = scales[gi];
#pragma omp simd
    for (int64_t i = g0; i < g1; ++i) out[i] = cpu_quant::fp8_value(row[i]) * s;
  }
}

}  // namespace

// x [M, K] float32; data [N, K] uint8 (float8_e4m3fn bits); scales [N, ceil(K / group)] float32.
torch::Tensor fp8_linear(const torch::Tensor& x_in, const torch::Tensor& data, const torch::Tensor& scales,
                         int64_t group) {
  check_fp8(data, scales, group);
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == torch::kFloat && x_in.size(1) == data.size(1),
              "x must be [rows, in] float32");
  const auto x = x_in.contiguous();
  const int64_t m = x.size(0), n = data.size(0), k = data.size(1), groups = scales.size(1);
  auto y = torch::empty({m, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = data.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(k);
    for (int64_t j = begin; j < end; ++j) {
      if (j + 1 < end) __builtin_prefetch(wp + (j + 1) * k);
      widen_row(wp + j * k, sp + j * groups, k, group, row.data());
      for (int64_t r = 0; r < m; ++r) {
        const float* xr = xp + r * k;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t i = 0; i < k; ++i) acc += xr[i] * row[i];
        yp[r * n + j] = acc;
      }
    }
  });
  return y;
}

// W as float32 [N, K].
torch::Tensor fp8_dequantize(const torch::Tensor& data, const torch::Tensor& scales, int64_t group) {
  check_fp8(data, scales, group);
  const int64_t n = data.size(0), k = data.size(1), groups = scales.size(1);
  auto out = torch::empty({n, k}, scales.options());
  const uint8_t* wp = data.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) widen_row(wp + j * k, sp + j * groups, k, group, op + j * k);
  });
  return out;
}

void bind_cpu_quant(pybind11::module& m) {
  m.def("fp8_linear", &fp8_linear, "x W^T against an FP8 weight with group scales (few rows)");
  m.def("fp8_dequantize", &fp8_dequantize, "an FP8 weight with group scales as float32");
}
