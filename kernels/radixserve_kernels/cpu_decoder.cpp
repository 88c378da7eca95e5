// The decoder layers of a float32 or bf16 Llama-family model in one call, for the CPU forward.
//
// Each layer runs the same kernels the Python layers call one by one (packed GEMM, rotary, KV
// store, paged attention, fused residual add and RMSNorm, SwiGLU), in the same order on the same
// values, so the results are identical. What goes is everything between the kernels: the Python
// (module calls, views, argument conversion: ~140 us a layer on a 2-core Zen 1), and the
// parallel regions. The whole call is one region of a team of threads (cpu_parallel.h) that
// runs the layers' phases with a barrier between them, into buffers allocated once per call;
// one region per kernel left the other threads waiting while the calling thread allocated
// outputs and ran the small kernels alone. Attention groups come planned by the torch backend
// (torch_native.py). With LoRA adapters (set_lora) a GEMM's output gets each adapter row's
// delta x A^T B^T right after it, in two phases: the rank-sized shrink, then the expand.
// A bf16 model runs the same way with its weights packed in bf16 (each GEMM first rounds its
// input rows to bf16) and its K/V pool in bf16 (rows rounded as they are stored, widened as
// attention reads them); the residual stream and everything between the GEMMs stay float32.
#include <torch/extension.h>
#include "cpu_bindings.h"
#include <algorithm>
#include <atomic>
#include <cstring>
#include <tuple>
#include <vector>
#include "cpu_layer_ops.h"
#include "cpu_parallel.h"

namespace {

using cpu_layer_ops::AttentionIo;
using cpu_layer_ops::AttentionScratch;
using cpu_layer_ops::DecodeAttention;
using cpu_layer_ops::ExtendAttention;
using cpu_layer_ops::PackedGemm;
using cpu_parallel::SharedUnits;
using cpu_parallel::Team;

// One layer's weights; out_norm is the norm after the layer's MLP residual add: the next layer's
// input norm, or the model's final norm after the last layer.
struct LayerWeights {
  torch::Tensor qkv, qkv_bias, o, post_norm, gate_up, down, out_norm;  // qkv_bias undefined: none
  int64_t qkv_out, o_out, gate_up_out, down_out;
};

constexpr int64_t kSiluSpan = 256;  // values of a row a SwiGLU work item covers

const int64_t* int64_data(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == torch::kLong && t.dim() == 1 && t.is_contiguous(), "CpuDecoder: ", what,
              " must be a contiguous 1-d int64 tensor");
  return t.data_ptr<int64_t>();
}

// A step's attention group with the per-call parts of its plan: its tokens' queries and outputs
// are gathered into `q` and `out` [tokens, heads, dim] unless the group is the whole step in order.
struct GroupPlan {
  const int64_t* tokens;
  int64_t count;
  bool gathered;
  torch::Tensor q, out;
  DecodeAttention decode;  // when !is_extend
  ExtendAttention extend;  // when is_extend
  bool is_extend;
};

// One linear layer's adapter deltas, stacked by pool slot: A [slots, rank, in], B [slots, out,
// rank] (lora_weights.LoraPool; the scaling folded into B). Undefined: not targeted.
struct LoraPair {
  torch::Tensor a, b;
};

// A token of this step that runs on an adapter, and that adapter's pool slot.
struct LoraRow {
  int64_t token, slot;
};

// Where a token's query and attention output lie in its group's gathered buffers.
struct GatheredRows {
  float* q;
  const float* out;
};

}  // namespace

// A step's attention groups, as the torch backend plans them: a decode group is
// (tokens, rows, seq_lens), an extend group (tokens, rows, prefix_lens, extend_lens); `tokens`
// (the group's indices among the step's tokens) is read only when there are several groups.
using Groups = std::vector<std::vector<torch::Tensor>>;

class CpuDecoder {
 public:
  // weights: per layer, in order, the packed q/k/v projection, its bias (an empty tensor for
  // none), the packed o projection, the post-attention norm, the packed gate/up and down
  // projections, and the norm after the layer; caches: each layer's K and V pool tensors.
  CpuDecoder(const std::vector<torch::Tensor>& weights, const std::vector<int64_t>& out_features,
             std::vector<torch::Tensor> k_caches, std::vector<torch::Tensor> v_caches, int64_t heads,
             int64_t kv_heads, int64_t head_dim, double eps, double scale)
      : k_caches_(std::move(k_caches)), v_caches_(std::move(v_caches)), heads_(heads), kv_heads_(kv_heads),
        head_dim_(head_dim), eps_(static_cast<float>(eps)), scale_(static_cast<float>(scale)) {
    constexpr size_t kPerLayer = 7;
    TORCH_CHECK(weights.size() % kPerLayer == 0 && out_features.size() == weights.size() / kPerLayer * 4,
                "CpuDecoder: 7 weights and 4 output sizes per layer");
    TORCH_CHECK(k_caches_.size() == weights.size() / kPerLayer && v_caches_.size() == k_caches_.size(),
                "CpuDecoder: one K and one V cache per layer");
    TORCH_CHECK(heads % kv_heads == 0 && head_dim % 2 == 0, "CpuDecoder: heads a multiple of KV heads, even head dim");
    const auto cache_type = k_caches_[0].scalar_type();
    TORCH_CHECK(cache_type == torch::kFloat || cache_type == torch::kBFloat16, "CpuDecoder: float32 or bf16 caches");
    bf16_kv_ = cache_type == torch::kBFloat16;
    for (size_t l = 0; l < k_caches_.size(); ++l) {
      const auto& k = k_caches_[l];
      TORCH_CHECK(k.scalar_type() == cache_type && k.is_contiguous() && k.dim() == 3 && k.size(1) == kv_heads &&
                  k.size(2) == head_dim && v_caches_[l].sizes() == k.sizes() && v_caches_[l].is_contiguous() &&
                  v_caches_[l].scalar_type() == cache_type && k.sizes() == k_caches_[0].sizes(),
                  "CpuDecoder: caches [slots, kv_heads, head_dim] of one dtype, all of one shape");
    }
    for (size_t i = 0; i < weights.size(); i += kPerLayer) {
      const int64_t* n = out_features.data() + i / kPerLayer * 4;
      const auto& bias = weights[i + 1];
      layers_.push_back({weights[i], bias.numel() ? bias : torch::Tensor(), weights[i + 2], weights[i + 3],
                         weights[i + 4], weights[i + 5], weights[i + 6], n[0], n[1], n[2], n[3]});
    }
  }

  // The adapter pool's A and B for each layer's four GEMMs in order (q/k/v, o, gate/up, down):
  // 8 tensors per layer, empty ones for a GEMM no adapter targets.
  void set_lora(const std::vector<torch::Tensor>& pairs) {
    TORCH_CHECK(pairs.size() == layers_.size() * 8, "CpuDecoder: an A and a B per GEMM");
    std::vector<LoraPair> lora;
    int64_t rank = 0;
    for (size_t i = 0; i < pairs.size(); i += 2) {
      const auto &a = pairs[i], &b = pairs[i + 1];
      if (!a.numel()) {
        lora.push_back({});
        continue;
      }
      const LayerWeights& w = layers_[i / 8];
      const int64_t hidden = w.o_out, outs[] = {w.qkv_out, w.o_out, w.gate_up_out, w.down_out};
      const int64_t ins[] = {hidden, heads_ * head_dim_, hidden, w.gate_up_out / 2};
      const int64_t out = outs[i / 2 % 4], in = ins[i / 2 % 4];
      TORCH_CHECK(a.scalar_type() == torch::kFloat && b.scalar_type() == torch::kFloat && a.is_contiguous() &&
                  b.is_contiguous() && a.dim() == 3 && b.dim() == 3 && b.size(0) == a.size(0) && b.size(1) == out &&
                  b.size(2) == a.size(1) && a.size(2) == in, "CpuDecoder: LoRA A [slots, rank, in] and B [slots, out, rank], float32");
      lora.push_back({a, b});
      rank = std::max(rank, a.size(1));
    }
    lora_ = std::move(lora);
    lora_rank_ = rank;
  }

  // x [T, hidden] (updated in place: the residual stream), normed = the first layer's input
  // norm of x, cos/sin [T, 1, D/2]; returns the final norm of the last layer's output.
  // lora_runs [n, 3] int64: (start, end, slot) runs of tokens on an adapter slot (none: [0, 3]).
  torch::Tensor forward(torch::Tensor x, torch::Tensor normed, torch::Tensor cos, torch::Tensor sin,
                        torch::Tensor out_cache_loc, torch::Tensor req_to_token, const Groups& groups,
                        torch::Tensor lora_runs) const {
    const int64_t tokens = x.size(0), hidden = x.size(1);
    TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2 && x.is_contiguous() && normed.sizes() == x.sizes(),
                "CpuDecoder: x and normed [T, hidden] float32, x contiguous");
    normed = normed.to(torch::kFloat).contiguous();
    cos = cos.to(torch::kFloat).contiguous();
    sin = sin.to(torch::kFloat).contiguous();
    TORCH_CHECK(cos.numel() == tokens * head_dim_ / 2 && sin.numel() == cos.numel(), "CpuDecoder: cos, sin [T, 1, D/2]");
    const int64_t* slots = int64_data(out_cache_loc, "out_cache_loc");
    TORCH_CHECK(out_cache_loc.size(0) == tokens, "CpuDecoder: one cache slot per token");
    const int64_t pool_slots = k_caches_[0].size(0);
    for (int64_t t = 0; t < tokens; ++t)
      TORCH_CHECK(slots[t] >= 0 && slots[t] < pool_slots, "CpuDecoder: slot ", slots[t], " out of range");
    TORCH_CHECK(req_to_token.scalar_type() == torch::kLong && req_to_token.dim() == 2 && req_to_token.stride(1) == 1,
                "CpuDecoder: req_to_token [rows, max_len] int64");

    const auto f32 = x.options();
    const int64_t q_size = heads_ * head_dim_;
    const LayerWeights& first = layers_[0];
    auto qkv = torch::empty({tokens, first.qkv_out}, f32), attended = torch::empty({tokens, q_size}, f32);
    auto delta = torch::empty({tokens, hidden}, f32), post = torch::empty({tokens, hidden}, f32);
    auto gate_up = torch::empty({tokens, first.gate_up_out}, f32), act = torch::empty({tokens, first.gate_up_out / 2}, f32);
    auto out = torch::empty({tokens, hidden}, f32);
    std::vector<GroupPlan> plans = plan_groups(groups, tokens, qkv, attended, req_to_token);
    const std::vector<LoraRow> lora_rows = plan_lora_rows(lora_runs, tokens);
    auto shrunk = torch::empty({tokens, lora_rank_}, f32);
    // A bf16 weight's GEMM input in bf16 (PackedGemm::x16), the widest input of the four.
    auto x16 = torch::empty({tokens, std::max({hidden, q_size, first.gate_up_out / 2})}, x.options().dtype(torch::kBFloat16));

    const std::vector<PackedGemm> gemms =
        plan_gemms(normed, qkv, attended, delta, post, gate_up, act, out, static_cast<uint16_t*>(x16.data_ptr()));
    std::vector<SharedUnits> units;  // one per GEMM, sized for the team that runs them
    units.reserve(gemms.size());
    std::vector<std::atomic<size_t>> next_extend_task(layers_.size() * plans.size());
    const Step step{x.data_ptr<float>(), hidden, tokens, slots, cos.data_ptr<float>(), sin.data_ptr<float>(),
                    qkv.data_ptr<float>(), attended.data_ptr<float>(), delta.data_ptr<float>(), post.data_ptr<float>(),
                    gate_up.data_ptr<float>(), act.data_ptr<float>(), out.data_ptr<float>(),
                    gathered_rows(plans, tokens), lora_rows, shrunk.data_ptr<float>()};
    cpu_parallel::run_team([&](const Team& team) {
      if (team.thread == 0)
        for (const auto& gemm : gemms) units.emplace_back(gemm.units, team.threads);
      team.barrier();
      AttentionScratch scratch;
      for (size_t l = 0; l < layers_.size(); ++l) {
        // A bf16 GEMM's input rows are rounded into x16 by the phase that wrote them (the norms,
        // SwiGLU), as each row or span is done, or else in a phase of their own here.
        auto gemm = [&](size_t i) {
          const PackedGemm& g = gemms[l * 4 + i];
          const bool rounded = (i == 0 && l > 0) || i == 2 || i == 3;
          if (g.x16 != nullptr && !rounded) {
            const auto [begin, end] = team.share(g.rows);
            g.input_to_bf16(begin, end);
            team.barrier();
          }
          units[l * 4 + i].take_all(team.thread, [&](int64_t u, bool front) { g.run_unit(u, front); });
          team.barrier();
          if (!step.lora_rows.empty() && lora_[l * 4 + i].a.defined()) add_lora(team, step, lora_[l * 4 + i], g);
        };
        gemm(0);
        rotate_and_store(team, step, l);
        attend(team, l, plans, next_extend_task.data() + l * plans.size(), scratch, step);
        gemm(1);
        add_norm(team, step, step.post, layers_[l].post_norm, &gemms[l * 4 + 2]);
        gemm(2);
        swiglu(team, step, layers_[l].gate_up_out / 2, gemms[l * 4 + 3]);
        gemm(3);
        add_norm(team, step, step.out, layers_[l].out_norm, l + 1 < layers_.size() ? &gemms[(l + 1) * 4] : nullptr);
      }
    });
    return out;
  }

 private:
  // The call's buffers: the residual stream x, each token's cache slot and rotary tables, and the
  // layer's intermediate results, all [tokens, width] row-major.
  struct Step {
    float* x;
    int64_t hidden, tokens;
    const int64_t* slots;
    const float *cos, *sin;
    float *qkv, *attended, *delta, *post, *gate_up, *act, *out;
    std::vector<GatheredRows> gathered;  // per token, where groups are gathered; else empty
    std::vector<LoraRow> lora_rows;      // the tokens on an adapter; empty: none this step
    float* shrunk;                       // [tokens, lora_rank_]: x A^T of the GEMM at hand
  };

  // Each layer's four GEMMs in order (q/k/v, o, gate/up, down), planned against the call's
  // buffers; the first layer reads `normed`, the others the previous layer's output.
  std::vector<PackedGemm> plan_gemms(const torch::Tensor& normed, const torch::Tensor& qkv, const torch::Tensor& attended,
                                     const torch::Tensor& delta, const torch::Tensor& post, const torch::Tensor& gate_up,
                                     const torch::Tensor& act, const torch::Tensor& out, uint16_t* x16) const {
    const int64_t tokens = normed.size(0), hidden = normed.size(1), q_size = heads_ * head_dim_;
    const int64_t kv_size = kv_heads_ * head_dim_;
    std::vector<PackedGemm> gemms;
    for (size_t l = 0; l < layers_.size(); ++l) {
      const LayerWeights& w = layers_[l];
      TORCH_CHECK(w.qkv_out == qkv.size(1) && w.gate_up_out == gate_up.size(1) && w.o_out == hidden &&
                  w.down_out == hidden && w.qkv_out == q_size + 2 * kv_size, "CpuDecoder: layers of one shape");
      const float* in = l == 0 ? normed.data_ptr<float>() : out.data_ptr<float>();
      const float* bias = w.qkv_bias.defined() ? w.qkv_bias.data_ptr<float>() : nullptr;
      gemms.push_back(
          cpu_layer_ops::plan_packed_gemm(w.qkv, in, tokens, hidden, bias, qkv.data_ptr<float>(), w.qkv_out, x16));
      gemms.push_back(cpu_layer_ops::plan_packed_gemm(w.o, attended.data_ptr<float>(), tokens, q_size, nullptr,
                                                      delta.data_ptr<float>(), hidden, x16));
      gemms.push_back(cpu_layer_ops::plan_packed_gemm(w.gate_up, post.data_ptr<float>(), tokens, hidden, nullptr,
                                                      gate_up.data_ptr<float>(), w.gate_up_out, x16));
      gemms.push_back(cpu_layer_ops::plan_packed_gemm(w.down, act.data_ptr<float>(), tokens, act.size(1), nullptr,
                                                      delta.data_ptr<float>(), hidden, x16));
    }
    return gemms;
  }

  // The step's adapter tokens from its runs, checked against the pool.
  std::vector<LoraRow> plan_lora_rows(const torch::Tensor& runs, int64_t tokens) const {
    TORCH_CHECK(runs.scalar_type() == torch::kLong && runs.dim() == 2 && runs.size(1) == 3 && runs.is_contiguous(),
                "CpuDecoder: lora_runs [n, 3] int64");
    std::vector<LoraRow> rows;
    if (!runs.size(0)) return rows;
    TORCH_CHECK(!lora_.empty(), "CpuDecoder: LoRA runs without set_lora");
    int64_t slots = 0;
    for (const auto& p : lora_)
      if (p.a.defined()) slots = p.a.size(0);
    const int64_t* r = runs.data_ptr<int64_t>();
    for (int64_t i = 0; i < runs.size(0); ++i, r += 3) {
      TORCH_CHECK(0 <= r[0] && r[0] <= r[1] && r[1] <= tokens && 0 < r[2] && r[2] < slots,
                  "CpuDecoder: a LoRA run out of range");
      for (int64_t t = r[0]; t < r[1]; ++t) rows.push_back({t, r[2]});
    }
    return rows;
  }

  // out[t] += (x[t] A[slot]^T) B[slot]^T for each adapter token t of the GEMM `g` just run: the
  // shrink one (token, rank) dot product a work item, then the expand one (token, span of
  // kSiluSpan outputs) an item.
  void add_lora(const Team& team, const Step& s, const LoraPair& p, const PackedGemm& g) const {
    const int64_t rank = p.a.size(1), in = p.a.size(2), out = p.b.size(1);
    const float *a = p.a.data_ptr<float>(), *b = p.b.data_ptr<float>();
    const int64_t rows = static_cast<int64_t>(s.lora_rows.size());
    auto [begin, end] = team.share(rows * rank);
    for (int64_t i = begin; i < end; ++i) {
      const LoraRow& row = s.lora_rows[i / rank];
      const float* x = g.x + row.token * g.k;
      const float* a_row = a + (row.slot * rank + i % rank) * in;
      float acc = 0.f;
      for (int64_t k = 0; k < in; ++k) acc += x[k] * a_row[k];
      s.shrunk[row.token * lora_rank_ + i % rank] = acc;
    }
    team.barrier();
    const int64_t spans = (out + kSiluSpan - 1) / kSiluSpan;
    std::tie(begin, end) = team.share(rows * spans);
    for (int64_t i = begin; i < end; ++i) {
      const LoraRow& row = s.lora_rows[i / spans];
      const float* shrunk = s.shrunk + row.token * lora_rank_;
      float* y = g.y + row.token * g.n;
      const int64_t c0 = i % spans * kSiluSpan, c1 = std::min(out, c0 + kSiluSpan);
      for (int64_t c = c0; c < c1; ++c) {
        const float* b_row = b + (row.slot * out + c) * rank;
        float acc = 0.f;
        for (int64_t r = 0; r < rank; ++r) acc += shrunk[r] * b_row[r];
        y[c] += acc;
      }
    }
    team.barrier();
  }

  // Each token's rows in its group's gathered queries and outputs, when groups are gathered.
  std::vector<GatheredRows> gathered_rows(const std::vector<GroupPlan>& plans, int64_t tokens) const {
    if (!plans[0].gathered) return {};
    const int64_t q_size = heads_ * head_dim_;
    std::vector<GatheredRows> rows(tokens, GatheredRows{nullptr, nullptr});
    for (const auto& p : plans)
      for (int64_t i = 0; i < p.count; ++i) rows[p.tokens[i]] = {p.q.data_ptr<float>() + i * q_size, p.out.data_ptr<float>() + i * q_size};
    for (const auto& r : rows) TORCH_CHECK(r.q != nullptr, "CpuDecoder: every token must be in a group");
    return rows;
  }

  std::vector<GroupPlan> plan_groups(const Groups& groups, int64_t tokens, const torch::Tensor& qkv,
                                     const torch::Tensor& attended, const torch::Tensor& req_to_token) const {
    TORCH_CHECK(!groups.empty(), "CpuDecoder: no attention groups");
    std::vector<GroupPlan> plans;
    const int64_t q_size = heads_ * head_dim_;
    for (const auto& g : groups) {
      TORCH_CHECK(g.size() == 3 || g.size() == 4, "CpuDecoder: a group is 3 or 4 tensors");
      GroupPlan p{int64_data(g[0], "a group's tokens"), g[0].size(0), false, {}, {}, {}, {}, g.size() == 4};
      for (int64_t i = 0; i < p.count; ++i)
        TORCH_CHECK(p.tokens[i] >= 0 && p.tokens[i] < tokens, "CpuDecoder: a group's token out of range");
      p.gathered = groups.size() > 1;
      if (p.gathered) {
        p.q = torch::empty({p.count, q_size}, qkv.options());
        p.out = torch::empty({p.count, q_size}, qkv.options());
      }
      // Queries are read from the fused projection (row stride qkv_out) unless gathered.
      const AttentionIo io{p.gathered ? p.q.data_ptr<float>() : qkv.data_ptr<float>(),
                           p.gathered ? q_size : qkv.size(1), k_caches_[0].stride(0),
                           k_caches_[0].stride(1), req_to_token.data_ptr<int64_t>(), req_to_token.stride(0),
                           p.gathered ? p.out.data_ptr<float>() : attended.data_ptr<float>(), q_size, heads_, kv_heads_,
                           head_dim_, scale_};
      const int64_t* rows = int64_data(g[1], "a group's rows");
      TORCH_CHECK(g[1].size(0) == (p.is_extend ? g[3].size(0) : p.count), "CpuDecoder: a group's rows and tokens differ");
      for (int64_t i = 0; i < g[1].size(0); ++i)
        TORCH_CHECK(rows[i] >= 0 && rows[i] < req_to_token.size(0), "CpuDecoder: a table row out of range");
      if (p.is_extend) {
        const int64_t* prefix = int64_data(g[2], "prefix_lens");
        const int64_t* extend = int64_data(g[3], "extend_lens");
        int64_t total = 0;
        for (int64_t i = 0; i < g[3].size(0); ++i) {
          TORCH_CHECK(extend[i] > 0 && prefix[i] >= 0 && prefix[i] + extend[i] <= req_to_token.size(1),
                      "CpuDecoder: an extend length out of range");
          total += extend[i];
        }
        TORCH_CHECK(total == p.count, "CpuDecoder: extend_lens must add up to the group's tokens");
        p.extend = cpu_layer_ops::plan_extend_attention(io, rows, prefix, extend, g[3].size(0), bf16_kv_);
      } else {
        const int64_t* lens = int64_data(g[2], "seq_lens");
        for (int64_t i = 0; i < p.count; ++i)
          TORCH_CHECK(lens[i] > 0 && lens[i] <= req_to_token.size(1), "CpuDecoder: a sequence length out of range");
        p.decode = DecodeAttention{io, rows, lens, p.count};
      }
      plans.push_back(std::move(p));
    }
    if (plans.size() == 1) TORCH_CHECK(plans[0].count == tokens, "CpuDecoder: one group must hold every token");
    return plans;
  }

  // Rotary on each token's q and k, its k and v into the caches, and its q into its group's
  // gathered queries where groups are gathered.
  void rotate_and_store(const Team& team, const Step& s, size_t layer) const {
    const int64_t q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_, half = head_dim_ / 2;
    const int64_t width = q_size + 2 * kv_size;
    const auto [begin, end] = team.share(s.tokens);
    for (int64_t t = begin; t < end; ++t) {
      float* row = s.qkv + t * width;
      cpu_layer_ops::rotate_token(row, heads_, head_dim_, half, s.cos + t * half, s.sin + t * half);
      cpu_layer_ops::rotate_token(row + q_size, kv_heads_, head_dim_, half, s.cos + t * half, s.sin + t * half);
      if (bf16_kv_) {
        auto* kc = k_caches_[layer].data_ptr<at::BFloat16>() + s.slots[t] * kv_size;
        auto* vc = v_caches_[layer].data_ptr<at::BFloat16>() + s.slots[t] * kv_size;
        for (int64_t i = 0; i < kv_size; ++i) kc[i] = row[q_size + i], vc[i] = row[q_size + kv_size + i];
      } else {
        std::memcpy(k_caches_[layer].data_ptr<float>() + s.slots[t] * kv_size, row + q_size, kv_size * sizeof(float));
        std::memcpy(v_caches_[layer].data_ptr<float>() + s.slots[t] * kv_size, row + q_size + kv_size,
                    kv_size * sizeof(float));
      }
      if (!s.gathered.empty()) std::memcpy(s.gathered[t].q, row, q_size * sizeof(float));
    }
    team.barrier();
  }

  // Every group's attention for this layer: decode tasks split evenly, extend tasks taken as
  // threads finish; then gathered outputs go back to their tokens' rows.
  void attend(const Team& team, size_t layer, const std::vector<GroupPlan>& plans, std::atomic<size_t>* next_extend,
              AttentionScratch& scratch, const Step& s) const {
    if (bf16_kv_)
      attend_with(team, plans, next_extend, scratch, k_caches_[layer].data_ptr<at::BFloat16>(),
                  v_caches_[layer].data_ptr<at::BFloat16>());
    else
      attend_with(team, plans, next_extend, scratch, k_caches_[layer].data_ptr<float>(),
                  v_caches_[layer].data_ptr<float>());
    if (s.gathered.empty()) return;
    const int64_t q_size = heads_ * head_dim_;
    const auto [begin, end] = team.share(s.tokens);
    for (int64_t t = begin; t < end; ++t) std::memcpy(s.attended + t * q_size, s.gathered[t].out, q_size * sizeof(float));
    team.barrier();
  }

  // The groups' tasks against one layer's caches of element type E.
  template <typename E>
  void attend_with(const Team& team, const std::vector<GroupPlan>& plans, std::atomic<size_t>* next_extend,
                   AttentionScratch& scratch, const E* kc, const E* vc) const {
    for (size_t g = 0; g < plans.size(); ++g) {
      const auto& p = plans[g];
      if (p.is_extend) {
        const auto& tasks = p.extend.tasks;
        for (size_t n = next_extend[g]++; n < tasks.size(); n = next_extend[g]++) p.extend.run_task(tasks[n], kc, vc, scratch);
      } else {
        const auto [begin, end] = team.share(p.decode.tasks());
        for (int64_t task = begin; task < end; ++task) p.decode.run_task(task, kc, vc, scratch);
      }
    }
    team.barrier();
  }

  // x += delta, then normed_out = rmsnorm(x) * weight, rows split between the threads; each row
  // also rounded for `next` (the GEMM that reads normed_out) when its weight is bf16.
  void add_norm(const Team& team, const Step& s, float* normed_out, const torch::Tensor& weight,
                const PackedGemm* next) const {
    const float* w = weight.data_ptr<float>();
    const auto [begin, end] = team.share(s.tokens);
    for (int64_t r = begin; r < end; ++r) {
      cpu_layer_ops::add_rms_norm_row(s.x + r * s.hidden, s.delta + r * s.hidden, w, normed_out + r * s.hidden, s.hidden,
                                      eps_);
      if (next != nullptr && next->x16 != nullptr) next->round_span(r, 0, s.hidden);
    }
    team.barrier();
  }

  // act = silu(gate) * up, in spans of kSiluSpan values split between the threads, each span also
  // rounded for `next` (the down projection) when its weight is bf16.
  void swiglu(const Team& team, const Step& s, int64_t width, const PackedGemm& next) const {
    const int64_t spans = (width + kSiluSpan - 1) / kSiluSpan;
    const auto [begin, end] = team.share(s.tokens * spans);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / spans, c0 = i % spans * kSiluSpan, c1 = std::min(width, c0 + kSiluSpan);
      const float* gate = s.gate_up + r * 2 * width;
      cpu_layer_ops::silu_mul_span(gate, gate + width, s.act + r * width, c0, c1);
      if (next.x16 != nullptr) next.round_span(r, c0, c1);
    }
    team.barrier();
  }

  std::vector<LayerWeights> layers_;
  std::vector<LoraPair> lora_;  // per layer and GEMM, once set_lora ran
  int64_t lora_rank_ = 0;       // the widest A's rank
  std::vector<torch::Tensor> k_caches_, v_caches_;
  bool bf16_kv_;  // the caches hold bf16, else float32
  int64_t heads_, kv_heads_, head_dim_;
  float eps_, scale_;
};

void bind_cpu_decoder(pybind11::module& m) {
  pybind11::class_<CpuDecoder>(m, "CpuDecoder", "the decoder layers of a float32 or bf16 model in one call (CPU)")
      .def(pybind11::init<const std::vector<torch::Tensor>&, const std::vector<int64_t>&, std::vector<torch::Tensor>,
                          std::vector<torch::Tensor>, int64_t, int64_t, int64_t, double, double>())
      .def("set_lora", &CpuDecoder::set_lora)
      .def("forward", &CpuDecoder::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
}
