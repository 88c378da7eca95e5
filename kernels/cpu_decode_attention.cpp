// Paged decode attention on CPU: one query token per request, reading K/V straight from the
// pool through the request-to-token table (no gathered copy). One task per (request, KV head)
// attends that head's group of query heads, so each key and value row is read once per group.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <limits>
#include <vector>
#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPrefetch = 8;
constexpr int64_t kValueBlock = 32;  // value rows a query group accumulates before the next block (8 KiB at head dim 64)  // rows ahead: slots are often scattered, so ask for them early

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

void softmax_rows(float* scores, int64_t rows, int64_t len) {
  for (int64_t g = 0; g < rows; ++g) {
    float* s = scores + g * len;
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
}

// The fast path for float32 with head_dim = 8 * Vecs: each key row is Vecs vector loads shared by
// the group's query heads, each value row is accumulated in registers, one query head at a time.
typedef float Vec8 __attribute__((vector_size(8 * sizeof(float))));

// Ask for every cache line of a row of `floats` floats (a head's key or value row spans several).
inline void prefetch_row(const float* row, int floats) {
  for (int i = 0; i < floats; i += 64 / sizeof(float)) __builtin_prefetch(row + i);
}

inline Vec8 load8(const float* p) { Vec8 v; std::memcpy(&v, p, sizeof(Vec8)); return v; }

inline float hsum8(Vec8 v) {
  const float a = (v[0] + v[4]) + (v[1] + v[5]), b = (v[2] + v[6]) + (v[3] + v[7]);
  return a + b;
}

#if defined(__AVX__)
// Eight horizontal sums at once, stored as eight floats: a transposing tree of hadds costs less
// than eight separate reductions.
inline void store_sums8(const Vec8* s, float* out) {
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(__m256(s[0]), __m256(s[1])), _mm256_hadd_ps(__m256(s[2]), __m256(s[3])));
  const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(__m256(s[4]), __m256(s[5])), _mm256_hadd_ps(__m256(s[6]), __m256(s[7])));
  // ab holds the low-half sums of rows 0-3 and then their high-half sums; cd the same for rows 4-7
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31)));
}
#else
inline void store_sums8(const Vec8* s, float* out) {
  for (int i = 0; i < 8; ++i) out[i] = hsum8(s[i]);
}
#endif

template <int Vecs>
inline Vec8 dot_vec(const float* q, const float* key) {
  Vec8 even = Vec8{}, odd = Vec8{};  // two chains hide the FMA latency
  for (int v = 0; v + 1 < Vecs; v += 2) {
    even += load8(q + 8 * v) * load8(key + 8 * v);
    odd += load8(q + 8 * v + 8) * load8(key + 8 * v + 8);
  }
  if (Vecs % 2) even += load8(q + 8 * (Vecs - 1)) * load8(key + 8 * (Vecs - 1));
  return even + odd;
}

template <int Vecs>
void attend_float(const float* qf, int64_t group, const float* kp, const float* vp, const int64_t* slots,
                  int64_t len, int64_t slot_stride, int64_t head_offset, float* scores, float* out,
                  int64_t out_head_stride) {
  int64_t t = 0;
  for (; t + 8 <= len; t += 8) {  // keys eight at a time, their scores reduced together
    const float* keys[8];
    for (int i = 0; i < 8; ++i) {
      keys[i] = kp + slots[t + i] * slot_stride + head_offset;
      if (t + i + kPrefetch < len) prefetch_row(kp + slots[t + i + kPrefetch] * slot_stride + head_offset, 8 * Vecs);
    }
    for (int64_t g = 0; g < group; ++g) {
      Vec8 sums[8];
      for (int i = 0; i < 8; ++i) sums[i] = dot_vec<Vecs>(qf + g * Vecs * 8, keys[i]);
      store_sums8(sums, scores + g * len + t);
    }
  }
  for (; t < len; ++t) {
    const float* key = kp + slots[t] * slot_stride + head_offset;
    for (int64_t g = 0; g < group; ++g) scores[g * len + t] = hsum8(dot_vec<Vecs>(qf + g * Vecs * 8, key));
  }
  softmax_rows(scores, group, len);
  for (int64_t g = 0; g < group; ++g) std::memset(out + g * out_head_stride, 0, sizeof(Vec8) * Vecs);
  for (int64_t t0 = 0; t0 < len; t0 += kValueBlock) {  // a block of value rows stays in L1 for the group
    const int64_t t1 = std::min(len, t0 + kValueBlock);
    for (int64_t g = 0; g < group; ++g) {
      const float* weights = scores + g * len;
      float* head_out = out + g * out_head_stride;
      Vec8 acc[Vecs];
      for (int v = 0; v < Vecs; ++v) acc[v] = load8(head_out + 8 * v);
      for (int64_t t = t0; t < t1; ++t) {
        if (g == 0 && t + kPrefetch < len) prefetch_row(vp + slots[t + kPrefetch] * slot_stride + head_offset, 8 * Vecs);
        const float* value = vp + slots[t] * slot_stride + head_offset;
        const float w = weights[t];
        for (int v = 0; v < Vecs; ++v) acc[v] += w * load8(value + 8 * v);
      }
      for (int v = 0; v < Vecs; ++v) std::memcpy(head_out + 8 * v, &acc[v], sizeof(Vec8));
    }
  }
}

using AttendFloat = void (*)(const float*, int64_t, const float*, const float*, const int64_t*, int64_t, int64_t,
                             int64_t, float*, float*, int64_t);

// The fast path for this head_dim, or nullptr (head_dim not a multiple of 8 up to 128).
AttendFloat attend_float_for(int64_t dim) {
  switch (dim) {
    case 32: return attend_float<4>;
    case 64: return attend_float<8>;
    case 80: return attend_float<10>;
    case 96: return attend_float<12>;
    case 128: return attend_float<16>;
    default: return nullptr;
  }
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
  const AttendFloat fast = std::is_same_v<T, float> ? attend_float_for(dim) : nullptr;
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qf(group * dim), acc(group * dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, kh = task % kv_heads, len = len_of[b];
      const int64_t* slots = table + row_of[b] * table_stride;
      scores.assign(group * len, 0.f);
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < dim; ++i)
          qf[g * dim + i] = static_cast<float>(qp[(b * heads + kh * group + g) * dim + i]) * static_cast<float>(scale);
      if (fast != nullptr) {
        fast(qf.data(), group, reinterpret_cast<const float*>(kp), reinterpret_cast<const float*>(vp), slots, len,
             slot_stride, kh * head_stride, scores.data(), reinterpret_cast<float*>(op) + (b * heads + kh * group) * dim, dim);
        continue;
      }
      for (int64_t t = 0; t < len; ++t) {
        if (t + kPrefetch < len) __builtin_prefetch(kp + slots[t + kPrefetch] * slot_stride + kh * head_stride);
        const T* key = kp + slots[t] * slot_stride + kh * head_stride;
        for (int64_t g = 0; g < group; ++g) scores[g * len + t] = dot(qf.data() + g * dim, key, dim);
      }
      softmax_rows(scores.data(), group, len);
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
