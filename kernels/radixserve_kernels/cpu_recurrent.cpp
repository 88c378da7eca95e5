// One decode step of the recurrent layers of hybrid models, in place on the states of the
// requests' rows: the gated delta rule (Qwen3.5, Qwen3-Next) and the Mamba2 scan (Nemotron-H,
// Falcon-H1). Each (request, head) state is read and written in two passes, with no gather or
// scatter of the rows and no temporaries; float32 throughout. The torch reference is
// radixserve/models/recurrent.py (gated_delta_rule_step) and mamba2.py (mamba2_step).
#include <torch/extension.h>
#include "cpu_bindings.h"
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

namespace {

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous(), name, " must be contiguous float32");
}

// states [slots, H, Dk, Dv]; q, k [B, H, Dk] (normalized, q scaled, one per value head);
// v [B, H, Dv]; decay = exp(g), beta [B, H]. S *= decay; u = beta (v - S^T k); S += k u^T;
// out = S^T q.
torch::Tensor gated_delta_step(torch::Tensor states, const torch::Tensor& rows, const torch::Tensor& q,
                               const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& decay,
                               const torch::Tensor& beta) {
  for (auto [t, n] : {std::pair{states, "states"}, {q, "q"}, {k, "k"}, {v, "v"}, {decay, "decay"}, {beta, "beta"}})
    check_f32(t, n);
  const int64_t batch = q.size(0), heads = q.size(1), dk = q.size(2), dv = v.size(2);
  TORCH_CHECK(states.size(1) == heads && states.size(2) == dk && states.size(3) == dv, "states shape");
  auto out = torch::empty({batch, heads, dv}, q.options());
  const auto rows_a = rows.to(torch::kLong).contiguous();
  const int64_t* rp = rows_a.data_ptr<int64_t>();
  float* sp = states.data_ptr<float>();
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *dp = decay.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> mem(dv), update(dv);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / heads, h = bh % heads;
      float* s = sp + (rp[b] * heads + h) * dk * dv;
      const float *qq = qp + bh * dk, *kk = kp + bh * dk, *vv = vp + bh * dv;
      const float d = dp[bh], bt = bp[bh];
      std::fill(mem.begin(), mem.end(), 0.f);
      for (int64_t i = 0; i < dk; ++i) {
        float* si = s + i * dv;
        const float ki = kk[i];
#pragma omp simd
        for (int64_t j = 0; j < dv; ++j) {
          si[j] *= d;
          mem[j] += ki * si[j];
        }
      }
#pragma omp simd
      for (int64_t j = 0; j < dv; ++j) update[j] = (vv[j] - mem[j]) * bt;
      float* o = op + bh * dv;
      std::fill(o, o + dv, 0.f);
      for (int64_t i = 0; i < dk; ++i) {
        float* si = s + i * dv;
        const float ki = kk[i], qi = qq[i];
#pragma omp simd
        for (int64_t j = 0; j < dv; ++j) {
          si[j] += ki * update[j];
          o[j] += qi * si[j];
        }
      }
    }
  });
  return out;
}

// states [slots, H, P, N]; x [B, H, P]; dt [B, H] (after softplus and clamp); a, d [H];
// b, c [B, G, N], each group's vector shared by H / G heads. S = exp(dt a) S + dt x b^T;
// out = S c + d x.
torch::Tensor mamba2_step(torch::Tensor states, const torch::Tensor& rows, const torch::Tensor& x,
                          const torch::Tensor& dt, const torch::Tensor& a, const torch::Tensor& b,
                          const torch::Tensor& c, const torch::Tensor& d) {
  for (auto [t, n] : {std::pair{states, "states"}, {x, "x"}, {dt, "dt"}, {a, "a"}, {b, "b"}, {c, "c"}, {d, "d"}})
    check_f32(t, n);
  const int64_t batch = x.size(0), heads = x.size(1), dim = x.size(2);
  const int64_t groups = b.size(1), size = b.size(2), per_group = heads / groups;
  TORCH_CHECK(states.size(1) == heads && states.size(2) == dim && states.size(3) == size, "states shape");
  auto out = torch::empty_like(x);
  const auto rows_a = rows.to(torch::kLong).contiguous();
  const int64_t* rp = rows_a.data_ptr<int64_t>();
  float* sp = states.data_ptr<float>();
  const float *xp = x.data_ptr<float>(), *tp = dt.data_ptr<float>(), *ap = a.data_ptr<float>();
  const float *bp = b.data_ptr<float>(), *cp = c.data_ptr<float>(), *dp = d.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t row = bh / heads, h = bh % heads, g = h / per_group;
      float* s = sp + (rp[row] * heads + h) * dim * size;
      const float* bb = bp + (row * groups + g) * size;
      const float* cc = cp + (row * groups + g) * size;
      const float* xx = xp + bh * dim;
      const float step = tp[bh], decay = std::exp(step * ap[h]);
      for (int64_t p = 0; p < dim; ++p) {
        float* sp_row = s + p * size;
        const float input = step * xx[p];
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t n = 0; n < size; ++n) {
          sp_row[n] = sp_row[n] * decay + input * bb[n];
          acc += sp_row[n] * cc[n];
        }
        op[bh * dim + p] = acc + dp[h] * xx[p];
      }
    }
  });
  return out;
}

}  // namespace

void bind_cpu_recurrent(pybind11::module& m) {
  m.def("gated_delta_step", &gated_delta_step,
        "one gated delta rule step, in place on states[rows] [rows, H, Dk, Dv] (float32)");
  m.def("mamba2_step", &mamba2_step, "one Mamba2 scan step, in place on states[rows] [rows, H, P, N] (float32)");
}
