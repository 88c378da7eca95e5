// Fused elementwise ops for the CPU forward: each replaces a chain of small torch ops (and
// their per-op dispatch cost) with one pass over the rows. float32 math for every dtype.
#include <torch/extension.h>
#include "cpu_bindings.h"
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <type_traits>
#include "cpu_layer_ops.h"
#include "cpu_simd.h"

namespace {

constexpr int64_t kGrainElements = 16384;  // rows per task: small steps stay on one thread

int64_t grain(int64_t width) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(width, 1)); }

template <typename T>
void rms_norm_rows(const torch::Tensor& x, const torch::Tensor& weight, torch::Tensor& out, double eps) {
  const int64_t rows = x.size(0), width = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = xp + r * width;
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < width; ++i) squares += static_cast<float>(row[i]) * static_cast<float>(row[i]);
      const float inv = 1.f / std::sqrt(squares / width + static_cast<float>(eps));
#pragma omp simd
      for (int64_t i = 0; i < width; ++i)
        op[r * width + i] = static_cast<T>(static_cast<float>(row[i]) * inv * static_cast<float>(wp[i]));
    }
  });
}

// x += delta, then out = rmsnorm(x): the residual add and the next norm in one pass over a row.
template <typename T>
void add_rms_norm_one(T* row, const T* add, const T* wp, T* out, int64_t width, float eps) {
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < width; ++i) {
    const T sum = static_cast<T>(static_cast<float>(row[i]) + static_cast<float>(add[i]));
    row[i] = sum;
    squares += static_cast<float>(sum) * static_cast<float>(sum);
  }
  const float inv = 1.f / std::sqrt(squares / width + eps);
#pragma omp simd
  for (int64_t i = 0; i < width; ++i) out[i] = static_cast<T>(static_cast<float>(row[i]) * inv * static_cast<float>(wp[i]));
}

template <typename T>
void add_rms_norm_rows(torch::Tensor& x, const torch::Tensor& delta, const torch::Tensor& weight, torch::Tensor& out,
                       double eps) {
  const int64_t rows = x.size(0), width = x.size(1);
  T* xp = x.data_ptr<T>();
  const T* dp = delta.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      add_rms_norm_one<T>(xp + r * width, dp + r * width, wp, op + r * width, width, static_cast<float>(eps));
  });
}

// out[c0:c1] = silu(gate[c0:c1]) * up[c0:c1].
template <typename T>
void silu_mul_one(const T* gate, const T* up, T* out, int64_t c0, int64_t c1) {
  int64_t i = c0;
#if defined(__AVX__)
  if constexpr (std::is_same_v<T, float>)  // e^-g eight at a time: glibc's expf went 4-wide (SSE) here
    for (; i + 8 <= c1; i += 8) {
      const Vec8 g = load8(gate + i);
      store8(out + i, g / (1.f + exp8(-g)) * load8(up + i));
    }
#endif
  for (; i < c1; ++i) {
    const float g = static_cast<float>(gate[i]);
    out[i] = static_cast<T>(g / (1.f + expf(-g)) * static_cast<float>(up[i]));
  }
}

template <typename T>
void silu_mul_rows(const torch::Tensor& gate_up, torch::Tensor& out) {
  const int64_t rows = gate_up.size(0), width = out.size(1);
  const T* gp = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  // Split from two rows on: at batch 8 half of gate_up comes from the other core's cache (the GEMM's
  // threads split its columns), and two threads fetch it faster (0.87 -> 0.61 ms a step's 30 layers).
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      silu_mul_one<T>(gp + r * 2 * width, gp + r * 2 * width + width, op + r * width, 0, width);
  });
}

// A token's heads (dim 2 * half each), rotated by its tables c, s [half].
template <typename T>
void rotate_one(T* x, int64_t heads, int64_t head_stride, int64_t half, const float* c, const float* s) {
  for (int64_t h = 0; h < heads; ++h) {
    T* first = x + h * head_stride;
    T* second = first + half;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float a = static_cast<float>(first[i]), b = static_cast<float>(second[i]);
      first[i] = static_cast<T>(a * c[i] - b * s[i]);
      second[i] = static_cast<T>(b * c[i] + a * s[i]);
    }
  }
}

template <typename T>
void rotate_rows(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  T* xp = x.data_ptr<T>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, tokens, grain(heads * half * 2), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) rotate_one<T>(xp + t * token_stride, heads, head_stride, half, cp + t * half, sp + t * half);
  });
}

}  // namespace

namespace cpu_layer_ops {

void add_rms_norm_row(float* x, const float* delta, const float* weight, float* out, int64_t width, float eps) {
  add_rms_norm_one<float>(x, delta, weight, out, width, eps);
}

void silu_mul_span(const float* gate, const float* up, float* out, int64_t c0, int64_t c1) {
  silu_mul_one<float>(gate, up, out, c0, c1);
}

void rotate_token(float* x, int64_t heads, int64_t head_stride, int64_t half, const float* c, const float* s) {
  rotate_one<float>(x, heads, head_stride, half, c, s);
}

}  // namespace cpu_layer_ops

// x [T, H] -> x / rms(x) * weight
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && x.size(1) == weight.size(0), "rms_norm: x [T, H], weight [H]");
  x = x.contiguous();
  weight = weight.to(x.scalar_type()).contiguous();
  auto out = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm",
                                  [&] { rms_norm_rows<scalar_t>(x, weight, out, eps); });
  return out;
}

// x [T, H] += delta [T, H] in place; returns rmsnorm(x) * weight.
torch::Tensor add_rms_norm_(torch::Tensor x, torch::Tensor delta, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && delta.sizes() == x.sizes() && weight.dim() == 1 &&
              x.size(1) == weight.size(0), "add_rms_norm_: contiguous x [T, H], delta [T, H], weight [H]");
  delta = delta.to(x.scalar_type()).contiguous();
  weight = weight.to(x.scalar_type()).contiguous();
  auto out = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm_",
                                  [&] { add_rms_norm_rows<scalar_t>(x, delta, weight, out, eps); });
  return out;
}

// k_cache[slots[t]] = k[t] and v_cache[slots[t]] = v[t]: k, v [T, KVH, D] may be views into a
// fused projection (any token stride, contiguous heads); caches [slots, KVH, D] contiguous.
void store_kv_(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots, torch::Tensor k, torch::Tensor v) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              k_cache.sizes().slice(1) == k.sizes().slice(1) && v_cache.sizes() == k_cache.sizes(),
              "store_kv_: k, v [T, KVH, D]; caches [slots, KVH, D]");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 && v.stride(1) == v.size(2),
              "store_kv_: each token's heads must be contiguous");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type(),
              "store_kv_: k and v must have the caches' dtype");
  TORCH_CHECK(slots.size(0) == k.size(0) && slots.scalar_type() == torch::kLong, "store_kv_: one int64 slot per token");
  slots = slots.contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t bytes = k.size(1) * k.size(2) * k.element_size(), slots_total = k_cache.size(0);
  const auto* kp = static_cast<const char*>(k.data_ptr());
  const auto* vp = static_cast<const char*>(v.data_ptr());
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t k_stride = k.stride(0) * k.element_size(), v_stride = v.stride(0) * v.element_size();
  for (int64_t t = 0; t < k.size(0); ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < slots_total, "store_kv_: slot ", sp[t], " out of range");
  at::parallel_for(0, k.size(0), grain(bytes / 4), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(kc + sp[t] * bytes, kp + t * k_stride, bytes);
      std::memcpy(vc + sp[t] * bytes, vp + t * v_stride, bytes);
    }
  });
}

// x [R, V] float32 -> the index of each row's largest value [R] int64 (the first, on ties, as
// torch.argmax; a row with NaN gets some index in range). A vectorized max, then a vectorized
// search for it, 256 values at a time: torch's argmax took 2-3x as long on the LM head's output.
torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.size(1) > 0, "argmax_rows: float32 x [R, V]");
  x = x.contiguous();
  const int64_t rows = x.size(0), width = x.size(1);
  auto out = torch::empty({rows}, x.options().dtype(torch::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * width;
      float top = row[0];
#pragma omp simd reduction(max : top)
      for (int64_t i = 0; i < width; ++i) top = std::max(top, row[i]);
      int64_t index = 0;
      for (int64_t chunk = 0; chunk < width; chunk += 256) {
        const int64_t stop = std::min(width, chunk + 256);
        int hit = 0;
#pragma omp simd reduction(| : hit)
        for (int64_t i = chunk; i < stop; ++i) hit |= row[i] == top;
        if (!hit) continue;
        index = chunk;
        while (index + 1 < stop && row[index] != top) ++index;
        break;
      }
      op[r] = index;
    }
  });
  return out;
}

// gate_up [T, 2I] -> silu(gate) * up [T, I]
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_and_mul: gate_up [T, 2I]");
  gate_up = gate_up.contiguous();
  auto out = torch::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_and_mul",
                                  [&] { silu_mul_rows<scalar_t>(gate_up, out); });
  return out;
}

// x [T, heads, D] (a strided view is fine: head dims contiguous), rotated in place by the
// rotate-half rule with per-token tables cos, sin [T, D/2] (float32).
torch::Tensor rotary_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rotary_: x [T, heads, D] with contiguous head dims");
  cos = cos.to(torch::kFloat).contiguous().view({x.size(0), -1});
  sin = sin.to(torch::kFloat).contiguous().view({x.size(0), -1});
  TORCH_CHECK(cos.size(1) * 2 == x.size(2), "rotary_: tables must hold D/2 values per token");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary_",
                                  [&] { rotate_rows<scalar_t>(x, cos, sin); });
  return x;
}

void bind_cpu_fused_ops(pybind11::module& m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of each row");
  m.def("add_rms_norm_", &add_rms_norm_, "x += delta in place, then RMSNorm of each row of x");
  m.def("argmax_rows", &argmax_rows, "index of each row's largest value (float32)");
  m.def("store_kv_", &store_kv_, "write each token's K and V rows into the caches at its slot");
  m.def("silu_and_mul", &silu_and_mul, "SwiGLU activation: silu(gate) * up");
  m.def("rotary_", &rotary_, "rotate-half rotary embedding, in place");
}
