// The decoder layers of a float32 Llama-family model in one call, for the CPU forward.
//
// Each layer runs the same kernels the Python layers call one by one (packed GEMM, rotary, KV
// store, paged attention, fused residual add and RMSNorm, SwiGLU), in the same order on the same
// tensors, so the results are identical; what goes is the Python between them (module calls,
// views, argument conversion of every kernel call): ~140 us a layer on a 2-core Zen 1, 4.2 ms of
// a 30-layer decode step. Attention groups come planned by the torch backend (torch_native.py).
#include <torch/extension.h>
#include <vector>

torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& packed,
                            const c10::optional<torch::Tensor>& bias, int64_t n);  // cpu_linear.cpp
torch::Tensor add_rms_norm_(torch::Tensor x, torch::Tensor delta, torch::Tensor weight, double eps);  // cpu_fused_ops.cpp
void store_kv_(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots, torch::Tensor k, torch::Tensor v);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
torch::Tensor rotary_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor req_to_token, torch::Tensor rows, torch::Tensor seq_lens,
                                     double scale);  // cpu_attention.cpp
torch::Tensor paged_extend_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor req_to_token, torch::Tensor rows, torch::Tensor prefix_lens,
                                     torch::Tensor extend_lens, double scale);

namespace {

// One layer's weights; out_norm is the norm after the layer's MLP residual add: the next layer's
// input norm, or the model's final norm after the last layer.
struct LayerWeights {
  torch::Tensor qkv, qkv_bias, o, post_norm, gate_up, down, out_norm;  // qkv_bias undefined: none
  int64_t qkv_out, o_out, gate_up_out, down_out;
};

c10::optional<torch::Tensor> maybe(const torch::Tensor& t) {
  return t.defined() ? c10::optional<torch::Tensor>(t) : c10::nullopt;
}

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
        head_dim_(head_dim), eps_(eps), scale_(scale) {
    constexpr size_t kPerLayer = 7;
    TORCH_CHECK(weights.size() % kPerLayer == 0 && out_features.size() == weights.size() / kPerLayer * 4,
                "CpuDecoder: 7 weights and 4 output sizes per layer");
    TORCH_CHECK(k_caches_.size() == weights.size() / kPerLayer && v_caches_.size() == k_caches_.size(),
                "CpuDecoder: one K and one V cache per layer");
    for (size_t i = 0; i < weights.size(); i += kPerLayer) {
      const int64_t* n = out_features.data() + i / kPerLayer * 4;
      const auto& bias = weights[i + 1];
      layers_.push_back({weights[i], bias.numel() ? bias : torch::Tensor(), weights[i + 2], weights[i + 3],
                         weights[i + 4], weights[i + 5], weights[i + 6], n[0], n[1], n[2], n[3]});
    }
  }

  // x [T, hidden] (updated in place: the residual stream), normed = the first layer's input
  // norm of x, cos/sin [T, 1, D/2]; returns the final norm of the last layer's output.
  torch::Tensor forward(torch::Tensor x, torch::Tensor normed, torch::Tensor cos, torch::Tensor sin,
                        torch::Tensor out_cache_loc, torch::Tensor req_to_token, const Groups& groups) const {
    TORCH_CHECK(!groups.empty(), "CpuDecoder: no attention groups");
    for (const auto& g : groups) TORCH_CHECK(g.size() == 3 || g.size() == 4, "CpuDecoder: a group is 3 or 4 tensors");
    cos = cos.to(torch::kFloat).contiguous();
    sin = sin.to(torch::kFloat).contiguous();
    const int64_t tokens = x.size(0), q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    for (size_t l = 0; l < layers_.size(); ++l) {
      const LayerWeights& w = layers_[l];
      const auto qkv = packed_linear(normed, w.qkv, maybe(w.qkv_bias), w.qkv_out);
      auto q = rotary_(qkv.narrow(1, 0, q_size).view({tokens, heads_, head_dim_}), cos, sin);
      auto k = rotary_(qkv.narrow(1, q_size, kv_size).view({tokens, kv_heads_, head_dim_}), cos, sin);
      const auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, kv_heads_, head_dim_});
      store_kv_(k_caches_[l], v_caches_[l], out_cache_loc, k, v);
      const auto attended = attend(l, q, req_to_token, groups).flatten(1);
      normed = add_rms_norm_(x, packed_linear(attended, w.o, c10::nullopt, w.o_out), w.post_norm, eps_);
      const auto mlp = packed_linear(silu_and_mul(packed_linear(normed, w.gate_up, c10::nullopt, w.gate_up_out)),
                                     w.down, c10::nullopt, w.down_out);
      normed = add_rms_norm_(x, mlp, w.out_norm, eps_);
    }
    return normed;
  }

 private:
  torch::Tensor attend_group(size_t layer, const torch::Tensor& q, const torch::Tensor& req_to_token,
                             const std::vector<torch::Tensor>& g) const {
    if (g.size() == 3)
      return paged_decode_attention(q, k_caches_[layer], v_caches_[layer], req_to_token, g[1], g[2], scale_);
    return paged_extend_attention(q, k_caches_[layer], v_caches_[layer], req_to_token, g[1], g[2], g[3], scale_);
  }

  torch::Tensor attend(size_t layer, const torch::Tensor& q, const torch::Tensor& req_to_token,
                       const Groups& groups) const {
    if (groups.size() == 1) return attend_group(layer, q, req_to_token, groups[0]);
    auto out = torch::empty_like(q);
    for (const auto& g : groups) out.index_put_({g[0]}, attend_group(layer, q.index({g[0]}), req_to_token, g));
    return out;
  }

  std::vector<LayerWeights> layers_;
  std::vector<torch::Tensor> k_caches_, v_caches_;
  int64_t heads_, kv_heads_, head_dim_;
  double eps_, scale_;
};

void bind_cpu_decoder(pybind11::module& m) {
  pybind11::class_<CpuDecoder>(m, "CpuDecoder", "the decoder layers of a float32 model in one call (CPU)")
      .def(pybind11::init<const std::vector<torch::Tensor>&, const std::vector<int64_t>&, std::vector<torch::Tensor>,
                          std::vector<torch::Tensor>, int64_t, int64_t, int64_t, double, double>())
      .def("forward", &CpuDecoder::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
}
