// Paged decode attention on CPU: one query token per request, reading K/V straight from the
// pool through the request-to-token table (no gathered copy). One task per (request, KV head)
// attends that head's group of query heads, so each key and value row is read once per group.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kPrefetch = 8;  // rows ahead: slots are often scattered, so ask for them early

template <typename T>
inline float dot(const float* q, const T* k, int64_t d) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < d; ++i) acc += q[i] * static_cast<float>(k[i]);
  return acc;
}

template <typename T>
inline void axpy(float a, const T* v, float* out, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) out[i] += a * static_cast<float>(v[i]);
}

template <typename T>
void decode_kernel(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                   const torch::Tensor& req_to_token, const torch::Tensor& rows, const torch::Tensor& seq_lens,
                   torch::Tensor& out, double scale) {
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k_cache.size(1);
  const int64_t group = heads / kv_heads;
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* table = req_to_token.data_ptr<int64_t>();
  const int64_t* row_of = rows.data_ptr<int64_t>();
  const int64_t* len_of = seq_lens.data_ptr<int64_t>();
  const int64_t table_stride = req_to_token.stride(0), slot_stride = k_cache.stride(0), head_stride = k_cache.stride(1);
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qf(group * dim), acc(group * dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, kh = task % kv_heads, len = len_of[b];
      const int64_t* slots = table + row_of[b] * table_stride;
      scores.assign(group * len, 0.f);
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < dim; ++i)
          qf[g * dim + i] = static_cast<float>(qp[(b * heads + kh * group + g) * dim + i]) * static_cast<float>(scale);
      for (int64_t t = 0; t < len; ++t) {
        if (t + kPrefetch < len) __builtin_prefetch(kp + slots[t + kPrefetch] * slot_stride + kh * head_stride);
        const T* key = kp + slots[t] * slot_stride + kh * head_stride;
        for (int64_t g = 0; g < group; ++g) scores[g * len + t] = dot(qf.data() + g * dim, key, dim);
      }
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * len;
        const float top = *std::max_element(s, s + len);
        float total = 0.f;
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < len; ++t) {  // vectorized expf (libmvec) under -ffast-math
          s[t] = expf(s[t] - top);
          total += s[t];
        }
        const float inv = 1.f / total;
#pragma omp simd
        for (int64_t t = 0; t < len; ++t) s[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        if (t + kPrefetch < len) __builtin_prefetch(vp + slots[t + kPrefetch] * slot_stride + kh * head_stride);
        const T* value = vp + slots[t] * slot_stride + kh * head_stride;
        for (int64_t g = 0; g < group; ++g) axpy(scores[g * len + t], value, acc.data() + g * dim, dim);
      }
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < dim; ++i)
          op[(b * heads + kh * group + g) * dim + i] = static_cast<T>(acc[g * dim + i]);
    }
  });
}

}  // namespace

// q [B, H, D]; k_cache, v_cache [slots, KVH, D]; req_to_token [rows, max_len] int64; rows, seq_lens [B] int64.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor req_to_token, torch::Tensor rows, torch::Tensor seq_lens,
                                     double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "q and caches must be 3-d");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(k_cache.stride(2) == 1 && v_cache.stride(2) == 1 && k_cache.strides() == v_cache.strides(),
              "caches must share a layout with contiguous head dims");
  q = q.contiguous();
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode_kernel<scalar_t>(q, k_cache, v_cache, req_to_token.contiguous(), rows.contiguous(),
                            seq_lens.contiguous(), out, scale);
  });
  return out;
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);  // cpu_fused_ops.cpp
torch::Tensor silu_and_mul(torch::Tensor gate_up);
torch::Tensor rotary_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
torch::Tensor pack_linear_weight(const torch::Tensor& weight);  // cpu_linear.cpp
torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& packed,
                            const c10::optional<torch::Tensor>& bias, int64_t n);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention over the KV pool (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row");
  m.def("silu_and_mul", &silu_and_mul, "SwiGLU activation: silu(gate) * up");
  m.def("rotary_", &rotary_, "rotate-half rotary embedding, in place");
  m.def("pack_linear_weight", &pack_linear_weight, "pack an [out, in] float32 weight for packed_linear");
  m.def("packed_linear", &packed_linear, "x W^T + b against a packed float32 weight");
}
