// The float32 kernels (K/V caches of float32 or bf16) as work that a thread of a team does (cpu_parallel.h): the GEMM by units,
// attention by tasks, the elementwise ops by rows. The torch-facing functions in the .cpp files
// share these same pieces over at::parallel_for; the decoder (cpu_decoder.cpp) runs them all in
// one parallel region. Plans hold raw pointers; whoever builds one has checked the shapes.
#pragma once
#include <torch/extension.h>
#include <cstdint>
#include <vector>

namespace cpu_layer_ops {

// y [rows, n] = x [rows, k] W^T + bias against a weight packed by pack_linear_weight, in
// `units` units of work that any thread may run in any order (cpu_linear.cpp). A bf16 weight's
// GEMM reads its input from x16, the rows in bf16: input_to_bf16 fills it from x first, unless
// the caller holds the input in bf16 already.
struct PackedGemm {
  const float* x;     // float32 input rows (nullptr when only x16 holds them)
  const float* w;     // the packed 32-bit elements: floats, or pairs of bf16
  const float* bias;  // or nullptr
  float* y;
  int64_t rows, k, n, blocks, units_per_chunk, units;
  uint16_t* x16;      // bf16 weight: the input rows [rows, k] in bf16; nullptr for float32

  // Rows [begin, end) of x rounded into x16.
  void input_to_bf16(int64_t begin, int64_t end) const;
  // Columns [c0, c1) of row r of x rounded into x16.
  void round_span(int64_t r, int64_t c0, int64_t c1) const;

  // Unit `unit`; `front`: whether the thread runs through the units forwards (it prefetches the
  // weights of the one it most likely runs next).
  void run_unit(int64_t unit, bool front) const;
};

// Checks that `packed` holds an [n, k] weight; the GEMM of x [rows, k] (row stride k) into y;
// x16 [rows, k] is needed for a bf16 weight (ignored for a float32 one).
PackedGemm plan_packed_gemm(const torch::Tensor& packed, const float* x, int64_t rows, int64_t k, const float* bias,
                            float* y, int64_t n, uint16_t* x16 = nullptr);

// Per-thread buffers of the attention tasks, grown as needed.
struct AttentionScratch {
  std::vector<float> scores, queries, values, keys_t;
  // The AMX extend kernel's operands (cpu_attention.cpp): bf16 queries and weights, K and V as
  // bf16 pairs.
  std::vector<uint16_t> queries16, weights16;
  std::vector<uint32_t> key_pairs, value_pairs;
};

// Where attention reads and writes: queries q [T, heads, dim] (token stride q_stride, heads
// contiguous), the layout of the pool's K and V [slots, kv_heads, dim], the request-to-token
// table, the outputs [T, heads, dim] (token stride out_stride).
struct AttentionIo {
  const float* q;
  int64_t q_stride, slot_stride, head_stride;
  const int64_t* table;
  int64_t table_stride;
  float* out;
  int64_t out_stride, heads, kv_heads, dim;
  float scale;
};

// Decode: query b (one token of request b) attends over the seq_lens[b] slots of table row
// rows[b]; a task per (query, KV head), batch * kv_heads of them (cpu_attention.cpp).
struct DecodeAttention {
  AttentionIo io;
  const int64_t* rows;
  const int64_t* seq_lens;
  int64_t batch;

  int64_t tasks() const { return batch * io.kv_heads; }
  // Task `task` against one layer's K and V pool tensors, of element type E: float or
  // c10::BFloat16 (queries and outputs stay float32).
  template <typename E>
  void run_task(int64_t task, const E* k_cache, const E* v_cache, AttentionScratch& scratch) const;
};

// Extend: request b's extend_lens[b] new tokens follow request b-1's, token i of it at position
// prefix_lens[b] + i (causal); a task per (request, block of its new tokens, KV head), costliest
// first, that threads take as they finish (cpu_attention.cpp).
struct ExtendTask {
  int64_t request, token0, tokens, kv_head, keys;
};

struct ExtendAttention {
  AttentionIo io;
  const int64_t* rows;
  std::vector<ExtendTask> tasks;
  bool amx;  // tasks run on AMX tiles (a bf16 cache on a CPU with AMX-BF16), else the float kernel

  template <typename E>  // float or c10::BFloat16, as for DecodeAttention
  void run_task(const ExtendTask& task, const E* k_cache, const E* v_cache, AttentionScratch& scratch) const;
};

// Builds the task list for a float32 or (bf16_cache) bf16 cache, on AMX tiles where the CPU and
// head dim allow; checks that the head dim has an extend kernel.
ExtendAttention plan_extend_attention(const AttentionIo& io, const int64_t* rows, const int64_t* prefix_lens,
                                      const int64_t* extend_lens, int64_t batch, bool bf16_cache);

// Row by row (cpu_fused_ops.cpp): x += delta, then out = rmsnorm(x) * weight.
void add_rms_norm_row(float* x, const float* delta, const float* weight, float* out, int64_t width, float eps);
// out[c0:c1] = silu(gate[c0:c1]) * up[c0:c1], within one row's gate and up halves.
void silu_mul_span(const float* gate, const float* up, float* out, int64_t c0, int64_t c1);
// A token's `heads` heads (head stride head_stride, dim 2 * half), rotated by the tables c, s [half].
void rotate_token(float* x, int64_t heads, int64_t head_stride, int64_t half, const float* c, const float* s);

}  // namespace cpu_layer_ops
