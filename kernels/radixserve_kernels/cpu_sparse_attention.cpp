// Sparse latent attention (DeepSeek-V3.2 and GLM-5's DSA): each query attends only to the pool
// rows its indexer selected. A row is one token's MLA latent (the first `value_dim` columns are
// also its value); every head of a query scores each selected row in one pass over the row, then
// sums the rows' values by the softmax in a second pass, so each row is read twice per query
// whatever the number of heads. float32 or bf16 rows, float32 arithmetic (a bf16 pool of V3.2's
// widths takes bf16 dot products for the scores where the CPU has AVX512-BF16). The torch reference is
// sparse_mla.sparse_latent_attention_reference.
#include <torch/extension.h>
#include "cpu_bindings.h"
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

#if defined(__AVX512BF16__)
// A bf16 pool's fast path, for widths that are multiples of 32 and values multiples of 64 (V3.2:
// 576 and 512): scores by bf16 dot products (q rounded to bf16, as a bf16 model's dense attention
// rounds it), eight rows at a time against one head's q; values summed in float32 four heads by
// 64 columns at a time, the row widened once for all four.
inline __m512 widen(const at::BFloat16* p) {
  const __m512i bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
}

void scores_bf16(const uint16_t* q, const at::BFloat16* rows, int64_t row_width, const int64_t* chosen,
                 int64_t topk, int64_t heads, int64_t width, float scale, float* scores) {
  for (int64_t j0 = 0; j0 < topk; j0 += 8) {
    const int64_t count = std::min<int64_t>(8, topk - j0);
    const at::BFloat16* r[8];
    for (int64_t j = 0; j < 8; ++j) {
      const int64_t slot = j < count && chosen[j0 + j] >= 0 ? chosen[j0 + j] : chosen[j0];
      r[j] = rows + std::max<int64_t>(slot, 0) * row_width;
    }
    for (int64_t h = 0; h < heads; ++h) {
      __m512 acc[8];
      for (auto& a : acc) a = _mm512_setzero_ps();
      const uint16_t* qh = q + h * width;
      for (int64_t c = 0; c < width; c += 32) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(qh + c);
        for (int64_t j = 0; j < 8; ++j)
          acc[j] = _mm512_dpbf16_ps(acc[j], qv, (__m512bh)_mm512_loadu_si512(r[j] + c));
      }
      for (int64_t j = 0; j < count; ++j) scores[h * topk + j0 + j] = _mm512_reduce_add_ps(acc[j]) * scale;
    }
  }
}

// out[h, :] += sum_j p[h, j] rows[j, :value_dim], heads a multiple of 4.
void values_bf16(const float* probs, const at::BFloat16* rows, int64_t row_width, const int64_t* chosen,
                 int64_t topk, int64_t heads, int64_t value_dim, float* out) {
  for (int64_t h0 = 0; h0 < heads; h0 += 4) {
    for (int64_t c0 = 0; c0 < value_dim; c0 += 64) {
      __m512 acc[4][4];
      for (auto& row : acc)
        for (auto& a : row) a = _mm512_setzero_ps();
      for (int64_t j = 0; j < topk; ++j) {
        if (chosen[j] < 0) continue;
        const at::BFloat16* r = rows + chosen[j] * row_width + c0;
        const __m512 v[4] = {widen(r), widen(r + 16), widen(r + 32), widen(r + 48)};
        for (int64_t h = 0; h < 4; ++h) {
          const __m512 p = _mm512_set1_ps(probs[(h0 + h) * topk + j]);
          for (int64_t k = 0; k < 4; ++k) acc[h][k] = _mm512_fmadd_ps(p, v[k], acc[h][k]);
        }
      }
      for (int64_t h = 0; h < 4; ++h)
        for (int64_t k = 0; k < 4; ++k) _mm512_storeu_ps(out + (h0 + h) * value_dim + c0 + 16 * k, acc[h][k]);
    }
  }
}

// The fast path's whole op; the softmax's division is left to the output.
void attend_selected_bf16(const float* qp, const at::BFloat16* rows, int64_t row_width, const int64_t* sp,
                          float* op, int64_t n, int64_t heads, int64_t width, int64_t topk, int64_t value_dim,
                          float scale) {
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(heads * topk);
    std::vector<uint16_t> q(heads * width);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t* chosen = sp + i * topk;
      for (int64_t c = 0; c < heads * width; c += 16) {
        const __m256bh b = _mm512_cvtneps_pbh(_mm512_loadu_ps(qp + i * heads * width + c));
        std::memcpy(q.data() + c, &b, sizeof(b));
      }
      scores_bf16(q.data(), rows, row_width, chosen, topk, heads, width, scale, scores.data());
      for (int64_t h = 0; h < heads; ++h) {
        float* sh = scores.data() + h * topk;
        float best = -std::numeric_limits<float>::infinity(), total = 0.f;
        for (int64_t j = 0; j < topk; ++j)
          if (chosen[j] >= 0) best = std::max(best, sh[j]);
        for (int64_t j = 0; j < topk; ++j) {
          sh[j] = chosen[j] >= 0 ? std::exp(sh[j] - best) : 0.f;
          total += sh[j];
        }
        const float inv = 1.f / total;
        for (int64_t j = 0; j < topk; ++j) sh[j] *= inv;
      }
      values_bf16(scores.data(), rows, row_width, chosen, topk, heads, value_dim, op + i * heads * value_dim);
    }
  });
}
#endif

// q [n, H, C] float32; rows [S, W] (W >= C); slots [n, K] int64, -1 where a query has fewer than
// K rows; out [n, H, value_dim] float32.
template <typename T>
void attend_selected(const float* qp, const T* rows, int64_t row_width, const int64_t* sp, float* op,
                     int64_t n, int64_t heads, int64_t width, int64_t topk, int64_t value_dim, float scale) {
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(heads * topk), row(width), best(heads), total(heads);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t* chosen = sp + i * topk;
      const float* q = qp + i * heads * width;
      std::fill(best.begin(), best.end(), -std::numeric_limits<float>::infinity());
      for (int64_t j = 0; j < topk; ++j) {
        if (chosen[j] < 0) continue;
        const T* r = rows + chosen[j] * row_width;
        for (int64_t c = 0; c < width; ++c) row[c] = static_cast<float>(r[c]);
        for (int64_t h = 0; h < heads; ++h) {
          const float* qh = q + h * width;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t c = 0; c < width; ++c) dot += qh[c] * row[c];
          scores[h * topk + j] = dot * scale;
          best[h] = std::max(best[h], dot * scale);
        }
      }
      float* out = op + i * heads * value_dim;
      std::fill(out, out + heads * value_dim, 0.f);
      std::fill(total.begin(), total.end(), 0.f);
      for (int64_t j = 0; j < topk; ++j) {
        if (chosen[j] < 0) continue;
        const T* r = rows + chosen[j] * row_width;
        for (int64_t c = 0; c < value_dim; ++c) row[c] = static_cast<float>(r[c]);
        for (int64_t h = 0; h < heads; ++h) {
          const float p = std::exp(scores[h * topk + j] - best[h]);
          total[h] += p;
          float* oh = out + h * value_dim;
#pragma omp simd
          for (int64_t c = 0; c < value_dim; ++c) oh[c] += p * row[c];
        }
      }
      for (int64_t h = 0; h < heads; ++h) {
        const float inv = total[h] > 0.f ? 1.f / total[h] : 0.f;
        float* oh = out + h * value_dim;
        for (int64_t c = 0; c < value_dim; ++c) oh[c] *= inv;
      }
    }
  });
}

torch::Tensor sparse_latent_attention(const torch::Tensor& q, const torch::Tensor& rows, const torch::Tensor& slots,
                                      double scale, int64_t value_dim) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(),
              "q must be contiguous float32 [n, heads, width]");
  TORCH_CHECK(rows.dim() == 2 && rows.stride(1) == 1, "rows must be [slots, row width] with unit column stride");
  TORCH_CHECK(slots.dim() == 2 && slots.scalar_type() == torch::kLong && slots.is_contiguous(),
              "slots must be contiguous int64 [n, topk]");
  const int64_t n = q.size(0), heads = q.size(1), width = q.size(2), topk = slots.size(1);
  TORCH_CHECK(slots.size(0) == n && width <= rows.size(1) && value_dim <= width, "shapes do not agree");
  auto out = torch::empty({n, heads, value_dim}, q.options());
  const float s = static_cast<float>(scale);
  if (rows.scalar_type() == torch::kFloat32) {
    attend_selected(q.data_ptr<float>(), rows.data_ptr<float>(), rows.stride(0), slots.data_ptr<int64_t>(),
                    out.data_ptr<float>(), n, heads, width, topk, value_dim, s);
  } else {
    TORCH_CHECK(rows.scalar_type() == torch::kBFloat16, "rows must be float32 or bfloat16");
#if defined(__AVX512BF16__)
    if (width % 32 == 0 && value_dim % 64 == 0 && heads % 4 == 0 && topk > 0) {
      attend_selected_bf16(q.data_ptr<float>(), rows.data_ptr<at::BFloat16>(), rows.stride(0),
                           slots.data_ptr<int64_t>(), out.data_ptr<float>(), n, heads, width, topk, value_dim, s);
      return out;
    }
#endif
    attend_selected(q.data_ptr<float>(), rows.data_ptr<at::BFloat16>(), rows.stride(0), slots.data_ptr<int64_t>(),
                    out.data_ptr<float>(), n, heads, width, topk, value_dim, s);
  }
  return out;
}

}  // namespace

void bind_cpu_sparse_attention(pybind11::module& m) {
  m.def("sparse_latent_attention", &sparse_latent_attention,
        "each query over its selected latent rows: q [n, H, C] f32, rows [S, W], slots [n, K] (-1: none)");
}
