// Paged attention on CPU, reading K/V straight from the pool through the request-to-token
// table (no gathered copy, no padding, no mask tensor).
// - Decode: one query token per request. One task per (request, KV head) attends that head's
//   group of query heads, so each key and value row is read once per group.
// - Extend: several new tokens per request after a cached prefix (prompt chunks, speculative
//   verify rows). One task per (request, block of new tokens, KV head), so each key and value
//   row is read once for the block's tokens times the group's heads; each token sees the keys
//   up to its own position (causal).
#include <torch/extension.h>
#include "cpu_bindings.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <limits>
#include <vector>
#include "cpu_amx.h"
#include "cpu_layer_ops.h"
#include "cpu_quant.h"
#include "cpu_simd.h"

namespace {

// Rows ahead: slots are often scattered, so ask for them early. The float32 decode kernel asks
// for nothing further ahead: a second, L2 prefetch 32 rows ahead of its keys and values, and
// one of the next task's rows during the value pass, made 30 layers of attention from DRAM take
// 1.09x the time at batch 8, context 256, 1.08x at context 1024 and 1.10x for one request at
// 1024, and 1.24x with K/V in cache (2-core Zen 1, interleaved in one process): more prefetch
// instructions than the loads they hide, on a stream the hardware prefetcher follows. Without
// them the batch-8 decode step took 0.98x the time at context 256 and 0.96x at 1024. On AVX-512
// the hint goes to L2 only (kPrefetchLocality), and from there 32 rows ahead measured 0.96-0.97x
// the time of 8 (the batch-8 decode step at context 256 and 1024, 2-core Zen 4).
#if defined(__AVX512F__)
constexpr int64_t kPrefetch = 32;
#else
constexpr int64_t kPrefetch = 8;
#endif
constexpr int64_t kValueBlock = 32;  // value rows a query group accumulates before the next block (8 KiB at head dim 64)
constexpr int64_t kQueryBlock = 16;  // new tokens an extend task attends for (times the group's heads)
constexpr int64_t kAmxQueryBlock = 64;  // the same for a task on AMX tiles (extend_amx)

inline float hsum8(Vec8 v) {
  const float a = (v[0] + v[4]) + (v[1] + v[5]), b = (v[2] + v[6]) + (v[3] + v[7]);
  return a + b;
}

// A row of `len` scores becomes e^(s - its max), in place; returns the row's total.
inline float exp_row(float* s, int64_t len) {
  float top = -std::numeric_limits<float>::infinity(), total = 0.f;
  int64_t t = 0;
#if defined(__AVX__)
  Vec8 tops = Vec8{} + top, totals = Vec8{};
  for (; t + 8 <= len; t += 8) {
    const Vec8 x = load8(s + t);
    tops = x > tops ? x : tops;
  }
  for (int i = 0; i < 8; ++i) top = std::max(top, tops[i]);
  for (int64_t i = t; i < len; ++i) top = std::max(top, s[i]);
  for (t = 0; t + 8 <= len; t += 8) {
    const Vec8 e = exp8(load8(s + t) - top);
    store8(s + t, e);
    totals += e;
  }
  total = hsum8(totals);
#else
  for (int64_t i = 0; i < len; ++i) top = std::max(top, s[i]);
#endif
  for (; t < len; ++t) total += (s[t] = expf(s[t] - top));
  return total;
}

// Each of `rows` rows of `len` scores (stride `ld`) becomes its softmax, in place.
void softmax_rows(float* scores, int64_t rows, int64_t len, int64_t ld) {
  for (int64_t g = 0; g < rows; ++g) {
    float* s = scores + g * ld;
    const float inv = 1.f / exp_row(s, len);
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) s[i] *= inv;
  }
}

// The fast path for float32 queries with head_dim = 8 * Vecs: register tiles of up to three
// query heads of the group, so that each key and value vector is loaded once for them all. E is
// the cache's element type, float or bf16 (widened to float as it is loaded).

// Eight cache values from p, as floats.
inline Vec8 load_row8(const float* p) { return load8(p); }
inline Vec8 load_row8(const c10::BFloat16* p) {
  typedef uint16_t Half8 __attribute__((vector_size(8 * sizeof(uint16_t))));
  Half8 bits;
  std::memcpy(&bits, p, sizeof(bits));
  const Int8 wide = __builtin_convertvector(bits, Int8) << 16;
  Vec8 out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

// Ask for every cache line of a row of `count` elements (a head's key or value row spans several).
template <typename E>
inline void prefetch_row(const E* row, int count) {
  for (int i = 0; i < count; i += 64 / static_cast<int>(sizeof(E))) __builtin_prefetch(row + i, 0, kPrefetchLocality);
}

// The horizontal sums of four vectors, stored at out[0], out[1], out[2], out[3].
inline void store_sums4(Vec8 a, Vec8 b, Vec8 c, Vec8 d, float* out) {
#if defined(__AVX__)
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(__m256(a), __m256(b)), _mm256_hadd_ps(__m256(c), __m256(d)));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
#else
  out[0] = hsum8(a), out[1] = hsum8(b), out[2] = hsum8(c), out[3] = hsum8(d);
#endif
}

// scores[g * len + t + i] = q_g . key_i for G query heads and four keys: 4 x G accumulators,
// each key vector loaded once for the G heads.
template <int Vecs, int G, typename E>
inline void score_tile(const float* qf, const E* const* keys, float* scores, int64_t len, int64_t t) {
  Vec8 acc[G][4];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 4; ++i) acc[g][i] = Vec8{};
  for (int v = 0; v < Vecs; ++v) {
    Vec8 qv[G];
    for (int g = 0; g < G; ++g) qv[g] = load8(qf + g * Vecs * 8 + 8 * v);
    for (int i = 0; i < 4; ++i) {
      const Vec8 kv = load_row8(keys[i] + 8 * v);
      for (int g = 0; g < G; ++g) acc[g][i] += kv * qv[g];
    }
  }
  for (int g = 0; g < G; ++g) store_sums4(acc[g][0], acc[g][1], acc[g][2], acc[g][3], scores + g * len + t);
}

// out[g][v0 + c] += sum over t in [t0, t1) of w[g * len + t] * (value row t)[v0 + c] for G heads
// and C vectors: G x C accumulators, each value vector loaded once for the G heads.
template <int G, int C, typename E>
inline void value_tile(const float* w, int64_t len, const E* const* values, int64_t t0, int64_t t1, int v0,
                       float* out, int64_t out_head_stride) {
  Vec8 acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = load8(out + g * out_head_stride + 8 * (v0 + c));
  for (int64_t t = t0; t < t1; ++t) {
    Vec8 wv[G];
    for (int g = 0; g < G; ++g) wv[g] = Vec8{} + w[g * len + t];
    for (int c = 0; c < C; ++c) {
      const Vec8 vv = load_row8(values[t - t0] + 8 * (v0 + c));
      for (int g = 0; g < G; ++g) acc[g][c] += wv[g] * vv;
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) store8(out + g * out_head_stride + 8 * (v0 + c), acc[g][c]);
}

// Where a task's K/V rows lie: its slots, how many, and its head's offset in a slot.
struct KvRows {
  const int64_t* slots;
  int64_t len, head_offset;
};

// Attention of G query heads (qf, scaled) over the rows of `task`.
template <int Vecs, int G, typename E>
void attend_heads(const float* qf, const E* kp, const E* vp, const KvRows& task, int64_t slot_stride,
                  float* scores, float* out, int64_t out_head_stride) {
  const int64_t* slots = task.slots;
  const int64_t len = task.len, head_offset = task.head_offset;
  int64_t t = 0;
  for (; t + 4 <= len; t += 4) {
    const E* keys[4];
    for (int i = 0; i < 4; ++i) {
      keys[i] = kp + slots[t + i] * slot_stride + head_offset;
      if (t + i + kPrefetch < len) prefetch_row(kp + slots[t + i + kPrefetch] * slot_stride + head_offset, 8 * Vecs);
    }
    score_tile<Vecs, G, E>(qf, keys, scores, len, t);
  }
  for (; t < len; ++t) {
    const E* key = kp + slots[t] * slot_stride + head_offset;
    for (int g = 0; g < G; ++g) {
      Vec8 acc = Vec8{};
      for (int v = 0; v < Vecs; ++v) acc += load8(qf + g * Vecs * 8 + 8 * v) * load_row8(key + 8 * v);
      scores[g * len + t] = hsum8(acc);
    }
  }
  float sums[G];  // the softmax's division is left to the output: one multiply per value, not per key
  for (int g = 0; g < G; ++g) sums[g] = exp_row(scores + g * len, len);
  for (int g = 0; g < G; ++g) std::memset(out + g * out_head_stride, 0, sizeof(Vec8) * Vecs);
  constexpr int C = 12 / G > 4 ? 4 : 12 / G;  // value vectors a tile holds: 12 accumulators of 16 registers
  for (int64_t t0 = 0; t0 < len; t0 += kValueBlock) {  // a block of value rows stays in L1 across the tiles
    const int64_t t1 = std::min(len, t0 + kValueBlock);
    const E* values[kValueBlock];
    for (int64_t t = t0; t < t1; ++t) {
      values[t - t0] = vp + slots[t] * slot_stride + head_offset;
      if (t + kPrefetch < len) prefetch_row(vp + slots[t + kPrefetch] * slot_stride + head_offset, 8 * Vecs);
    }
    int v0 = 0;
    for (; v0 + C <= Vecs; v0 += C) value_tile<G, C, E>(scores, len, values, t0, t1, v0, out, out_head_stride);
    for (; v0 < Vecs; ++v0) value_tile<G, 1, E>(scores, len, values, t0, t1, v0, out, out_head_stride);
  }
  for (int g = 0; g < G; ++g) {
    const Vec8 inv = Vec8{} + 1.f / sums[g];
    for (int v = 0; v < Vecs; ++v) store8(out + g * out_head_stride + 8 * v, load8(out + g * out_head_stride + 8 * v) * inv);
  }
}

// A (request, KV head) task: the group's query heads three at a time. In cache, 0.79x the time
// of one query head at a time (batch 1, context 256).
template <int Vecs, typename E>
void attend_float(const float* qf, int64_t group, const E* kp, const E* vp, const KvRows& task,
                  int64_t slot_stride, float* scores, float* out, int64_t out_head_stride) {
  for (int64_t g = 0; g < group;) {
    const int64_t n = std::min<int64_t>(3, group - g);
    const float* q = qf + g * Vecs * 8;
    float* o = out + g * out_head_stride;
    if (n == 3) attend_heads<Vecs, 3, E>(q, kp, vp, task, slot_stride, scores, o, out_head_stride);
    else if (n == 2) attend_heads<Vecs, 2, E>(q, kp, vp, task, slot_stride, scores, o, out_head_stride);
    else attend_heads<Vecs, 1, E>(q, kp, vp, task, slot_stride, scores, o, out_head_stride);
    g += n;
  }
}

template <typename E>
using AttendFloat = void (*)(const float*, int64_t, const E*, const E*, const KvRows&, int64_t, float*, float*, int64_t);

// The fast path for this head_dim, or nullptr (head_dim not a multiple of 8 up to 128).
template <typename E>
AttendFloat<E> attend_float_for(int64_t dim) {
  switch (dim) {
    case 32: return attend_float<4, E>;
    case 64: return attend_float<8, E>;
    case 80: return attend_float<10, E>;
    case 96: return attend_float<12, E>;
    case 128: return attend_float<16, E>;
    default: return nullptr;
  }
}

// A cache element as float: float32/bf16/fp16 as stored, a uint8 as float8_e4m3fn bits.
template <typename C>
inline float cache_value(C x) {
  if constexpr (std::is_same_v<C, uint8_t>) return cpu_quant::fp8_value(x);
  else return static_cast<float>(x);
}

template <typename C>
inline float dot(const float* q, const C* k, int64_t d) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < d; ++i) acc += q[i] * cache_value(k[i]);
  return acc;
}

template <typename C>
inline void axpy(float a, const C* v, float* out, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) out[i] += a * cache_value(v[i]);
}

// One (query, KV head) task of any dtype, without the fast path: a dot product per key. C is the
// cache's element type (T, or uint8 for an FP8 cache whose rows are k / k_scale, v / v_scale).
template <typename T, typename C>
void decode_task_generic(const T* qp, const C* kp, const C* vp, const int64_t* slots, int64_t len,
                         int64_t slot_stride, int64_t head_offset, int64_t group, int64_t dim, float scale,
                         float v_scale, T* out, cpu_layer_ops::AttentionScratch& s) {
  s.scores.assign(group * len, 0.f);
  s.queries.resize(group * dim);
  s.values.assign(group * dim, 0.f);
  for (int64_t g = 0; g < group; ++g)
    for (int64_t i = 0; i < dim; ++i) s.queries[g * dim + i] = static_cast<float>(qp[g * dim + i]) * scale;
  for (int64_t t = 0; t < len; ++t) {
    if (t + kPrefetch < len) __builtin_prefetch(kp + slots[t + kPrefetch] * slot_stride + head_offset);
    const C* key = kp + slots[t] * slot_stride + head_offset;
    for (int64_t g = 0; g < group; ++g) s.scores[g * len + t] = dot(s.queries.data() + g * dim, key, dim);
  }
  softmax_rows(s.scores.data(), group, len, len);
  for (int64_t t = 0; t < len; ++t) {
    if (t + kPrefetch < len) __builtin_prefetch(vp + slots[t + kPrefetch] * slot_stride + head_offset);
    const C* value = vp + slots[t] * slot_stride + head_offset;
    for (int64_t g = 0; g < group; ++g) axpy(s.scores[g * len + t], value, s.values.data() + g * dim, dim);
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t i = 0; i < dim; ++i) out[g * dim + i] = static_cast<T>(s.values[g * dim + i] * v_scale);
}

template <typename T, typename C>
void decode_kernel(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                   const torch::Tensor& req_to_token, const torch::Tensor& rows, const torch::Tensor& seq_lens,
                   torch::Tensor& out, double scale, double k_scale, double v_scale) {
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k_cache.size(1);
  const int64_t group = heads / kv_heads;
  const T* qp = q.data_ptr<T>();
  const C* kp = k_cache.data_ptr<C>();
  const C* vp = v_cache.data_ptr<C>();
  T* op = out.data_ptr<T>();
  const int64_t* table = req_to_token.data_ptr<int64_t>();
  const int64_t* row_of = rows.data_ptr<int64_t>();
  const int64_t* len_of = seq_lens.data_ptr<int64_t>();
  const int64_t table_stride = req_to_token.stride(0), slot_stride = k_cache.stride(0), head_stride = k_cache.stride(1);
  const int64_t q_stride = q.stride(0);
  if constexpr (std::is_same_v<T, float> && (std::is_same_v<C, float> || std::is_same_v<C, c10::BFloat16>)) {
    const cpu_layer_ops::DecodeAttention attention{
        {qp, q_stride, slot_stride, head_stride, table, table_stride, op, heads * dim, heads, kv_heads, dim,
         static_cast<float>(scale)},
        row_of, len_of, batch};
    at::parallel_for(0, attention.tasks(), 1, [&](int64_t begin, int64_t end) {
      cpu_layer_ops::AttentionScratch scratch;
      for (int64_t task = begin; task < end; ++task) attention.run_task(task, kp, vp, scratch);
    });
    return;
  }
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    cpu_layer_ops::AttentionScratch scratch;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, kh = task % kv_heads;
      decode_task_generic<T, C>(qp + b * q_stride + kh * group * dim, kp, vp, table + row_of[b] * table_stride,
                                len_of[b], slot_stride, kh * head_stride, group, dim,
                                static_cast<float>(scale * k_scale), static_cast<float>(v_scale),
                                op + (b * heads + kh * group) * dim, scratch);
    }
  });
}


// Extend, float32: scores of up to kScoreRows queries against a tile of kKeyTile keys held
// transposed (`kt` [dim][kKeyTile]), and their weighted values 16 dims at a time, as small GEMMs.
constexpr int64_t kKeyTile = 16;
constexpr int kScoreRows = 6;  // queries per register tile: 12 accumulators of the 16 registers

#if defined(__AVX__)  // the extend kernel transposes key tiles with AVX shuffles

// out[m][0:16] = (out[m][0:16] if accumulate, else 0) + sum_i a[m][i] * b[i][0:16] for `Rows`
// rows: a register tile of 2 * Rows accumulators; each step loads b[i]'s two vectors once and
// broadcasts one value per row, so the FMA units (not the loads) set the pace. Scores are
// a = queries, b = the transposed key tile's rows; weighted values are a = weights, b = values
// (cache rows of element type B).
template <int Rows, typename B>
inline void broadcast_tile(const float* const* a, const B* const* b, int64_t n, float* const* out, bool accumulate) {
  Vec8 acc[Rows][2];
  for (int m = 0; m < Rows; ++m) {
    acc[m][0] = accumulate ? load8(out[m]) : Vec8{};
    acc[m][1] = accumulate ? load8(out[m] + 8) : Vec8{};
  }
  for (int64_t i = 0; i < n; ++i) {
    Vec8 lo = load_row8(b[i]), hi = load_row8(b[i] + 8);
    asm("" : "+x"(lo), "+x"(hi));  // keep b's vectors in registers, not re-read per row
    for (int m = 0; m < Rows; ++m) {
      const Vec8 x = Vec8{} + a[m][i];
      acc[m][0] += x * lo;
      acc[m][1] += x * hi;
    }
  }
  for (int m = 0; m < Rows; ++m) {
    std::memcpy(out[m], &acc[m][0], sizeof(Vec8));
    std::memcpy(out[m] + 8, &acc[m][1], sizeof(Vec8));
  }
}

template <typename B>
using BroadcastTile = void (*)(const float* const*, const B* const*, int64_t, float* const*, bool);
template <typename B>
constexpr BroadcastTile<B> kBroadcastTile[kScoreRows] = {broadcast_tile<1, B>, broadcast_tile<2, B>,
                                                         broadcast_tile<3, B>, broadcast_tile<4, B>,
                                                         broadcast_tile<5, B>, broadcast_tile<6, B>};

// kt[d][i] = key i's d-th value for the tile's keys (zero past `count`), 8 x 8 blocks at a time.
template <typename E>
inline void transpose_keys(const E* const* keys, int64_t count, int64_t dim, float* kt) {
  for (int64_t i0 = 0; i0 < kKeyTile; i0 += 8)
    for (int64_t d0 = 0; d0 < dim; d0 += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) r[i] = __m256(i0 + i < count ? load_row8(keys[i0 + i] + d0) : Vec8{});
      const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
      const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
      const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
      const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
      const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
      const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
      const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
      const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
      float* o = kt + d0 * kKeyTile + i0;
      _mm256_storeu_ps(o + 0 * kKeyTile, _mm256_permute2f128_ps(u0, u4, 0x20));
      _mm256_storeu_ps(o + 1 * kKeyTile, _mm256_permute2f128_ps(u1, u5, 0x20));
      _mm256_storeu_ps(o + 2 * kKeyTile, _mm256_permute2f128_ps(u2, u6, 0x20));
      _mm256_storeu_ps(o + 3 * kKeyTile, _mm256_permute2f128_ps(u3, u7, 0x20));
      _mm256_storeu_ps(o + 4 * kKeyTile, _mm256_permute2f128_ps(u0, u4, 0x31));
      _mm256_storeu_ps(o + 5 * kKeyTile, _mm256_permute2f128_ps(u1, u5, 0x31));
      _mm256_storeu_ps(o + 6 * kKeyTile, _mm256_permute2f128_ps(u2, u6, 0x31));
      _mm256_storeu_ps(o + 7 * kKeyTile, _mm256_permute2f128_ps(u3, u7, 0x31));
    }
}

// `tokens` consecutive new tokens of one request, the first at position `first` (token i sees
// keys 0 .. first + i), for one KV head's `group` query heads. `qf` holds the scaled queries
// token-major ([tokens * group][dim], query j = token j / group, head j % group); `scores` has
// room for [tokens * group][ld] with ld = first + tokens rounded up to kKeyTile, `kt` for
// [dim][kKeyTile]. Output row of query j: out + (j / group) * out_token_stride + (j % group) * dim.
template <int Vecs, typename E>
void extend_float(const float* qf, int64_t tokens, int64_t group, int64_t first, const E* kp, const E* vp,
                  const int64_t* slots, int64_t slot_stride, int64_t head_offset, float* scores, float* kt,
                  float* out, int64_t out_token_stride) {
  constexpr int64_t dim = 8 * Vecs;
  const int64_t queries = tokens * group, len = first + tokens;
  const int64_t ld = (len + kKeyTile - 1) / kKeyTile * kKeyTile;
  auto seen = [&](int64_t j) { return first + j / group + 1; };  // keys query j attends over
  auto first_seeing = [&](int64_t t) { return group * std::max<int64_t>(0, t - first); };  // queries seeing key t
  const float* kt_rows[8 * Vecs];
  for (int64_t d = 0; d < dim; ++d) kt_rows[d] = kt + d * kKeyTile;
  for (int64_t t = 0; t < len; t += kKeyTile) {
    const int64_t count = std::min(kKeyTile, len - t);
    const E* keys[kKeyTile];
    for (int64_t i = 0; i < count; ++i) {
      keys[i] = kp + slots[t + i] * slot_stride + head_offset;
      if (t + i + kKeyTile < len) prefetch_row(kp + slots[t + i + kKeyTile] * slot_stride + head_offset, dim);
    }
    transpose_keys(keys, count, dim, kt);
    for (int64_t j = first_seeing(t); j < queries;) {
      const float* q[kScoreRows];
      float* o[kScoreRows];
      const int rows = static_cast<int>(std::min<int64_t>(kScoreRows, queries - j));
      for (int m = 0; m < rows; ++m) q[m] = qf + (j + m) * dim, o[m] = scores + (j + m) * ld + t;
      kBroadcastTile<float>[rows - 1](q, kt_rows, dim, o, false);
      j += rows;
    }
  }
  for (int64_t j = 0; j < queries; ++j) {
    float* row = scores + j * ld;
    softmax_rows(row, 1, seen(j), ld);
    std::fill(row + seen(j), row + len, 0.f);  // keys past the query's position weigh nothing
  }
  for (int64_t t0 = 0; t0 < len; t0 += kValueBlock) {  // a block of value rows stays in L1 for all queries
    const int64_t count = std::min(kValueBlock, len - t0);
    const E* values[kValueBlock];
    for (int64_t t = 0; t < count; ++t) {
      values[t] = vp + slots[t0 + t] * slot_stride + head_offset;
      if (t0 + t + kValueBlock < len) prefetch_row(vp + slots[t0 + t + kValueBlock] * slot_stride + head_offset, dim);
    }
    for (int64_t d0 = 0; d0 < dim; d0 += 16) {
      const E* shifted[kValueBlock];
      for (int64_t t = 0; t < count; ++t) shifted[t] = values[t] + d0;
      for (int64_t j = first_seeing(t0); j < queries;) {
        const float* w[kScoreRows];
        float* o[kScoreRows];
        const int rows = static_cast<int>(std::min<int64_t>(kScoreRows, queries - j));
        for (int m = 0; m < rows; ++m)
          w[m] = scores + (j + m) * ld + t0, o[m] = out + ((j + m) / group) * out_token_stride + ((j + m) % group) * dim + d0;
        kBroadcastTile<E>[rows - 1](w, shifted, count, o, t0 > 0);  // every query sees the first block
        j += rows;
      }
    }
  }
}

#endif  // __AVX__

#if RADIXSERVE_AMX
// Extend against a bf16 cache through AMX tiles, for head dims that are a multiple of 32: the
// task's queries (rounded to bf16) times each 16-key tile of K^T, the softmax of each query's
// row in float32 (its division left to the output), then its weights (rounded to bf16) times
// V, 32 keys a step. Both products take their B operand as pairs of bf16 along the summed
// dimension: K^T pairs dims (a 16 x 16 transpose of 32-bit words per 16 keys and 32 dims), V
// pairs neighbouring keys (two rows interleaved). Every query's row is computed over the key
// tiles from 0 on, and the tiles past its own position weigh zero, so its output does not
// depend on which task or batch it came in.
constexpr int64_t kAmxKeyTile = 16, kAmxValueStep = 32;

// out[w][j] = word w of row j (w < 16, j < 16), from 16 rows of 32-bit words (rows past `count`
// zero), their words word0 .. word0 + 15.
inline void transpose_words(const uint32_t* const* rows, int64_t count, int64_t word0, uint32_t* out) {
  __m512i r[16], t[16], u[16];
  for (int i = 0; i < 16; ++i) r[i] = i < count ? _mm512_loadu_si512(rows[i] + word0) : _mm512_setzero_si512();
  for (int i = 0; i < 16; i += 2) t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  for (int g = 0; g < 16; g += 4) {  // u[g + c], lane L: rows g .. g + 3 of word 4L + c
    u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xDD);
    const __m512i w0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88), w1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xDD);
    _mm512_storeu_si512(out + c * 16, _mm512_shuffle_i32x4(v0, w0, 0x88));
    _mm512_storeu_si512(out + (c + 4) * 16, _mm512_shuffle_i32x4(v1, w1, 0x88));
    _mm512_storeu_si512(out + (c + 8) * 16, _mm512_shuffle_i32x4(v0, w0, 0xDD));
    _mm512_storeu_si512(out + (c + 12) * 16, _mm512_shuffle_i32x4(v1, w1, 0xDD));
  }
}

// out[d] = (a[d], b[d]) as one 32-bit word for d < dim (a multiple of 32); a or b nullptr: zeros.
inline void interleave_rows(const uint16_t* a, const uint16_t* b, int64_t dim, uint32_t* out) {
  static const __m512i low = [] {
    alignas(64) uint16_t idx[32];
    for (int m = 0; m < 16; ++m) idx[2 * m] = m, idx[2 * m + 1] = 32 + m;
    return _mm512_load_si512(idx);
  }();
  const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
  for (int64_t d = 0; d < dim; d += 32) {
    const __m512i x = a ? _mm512_loadu_si512(a + d) : _mm512_setzero_si512();
    const __m512i y = b ? _mm512_loadu_si512(b + d) : _mm512_setzero_si512();
    _mm512_storeu_si512(out + d, _mm512_permutex2var_epi16(x, low, y));
    _mm512_storeu_si512(out + d + 16, _mm512_permutex2var_epi16(x, high, y));
  }
}

// weights[0:n] = e^(scores[0:n] - their max) rounded to bf16, weights[n:width] = 0; returns the
// sum of the e^ in float32, by which the weighted values are divided (the softmax, one pass over
// the scores less than dividing them first).
inline float exp_to_bf16(const float* scores, int64_t n, int64_t width, uint16_t* weights) {
  auto mask = [&](int64_t i) { return static_cast<__mmask16>(n - i >= 16 ? 0xffff : (1u << (n - i)) - 1); };
  __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n; i += 16) top = _mm512_mask_max_ps(top, mask(i), top, _mm512_maskz_loadu_ps(mask(i), scores + i));
  const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  __m512 total = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 e = _mm512_maskz_mov_ps(mask(i), __m512(exp16(Vec16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask(i), scores + i), max)))));
    total = _mm512_add_ps(total, e);
    const __m256bh w = _mm512_cvtneps_pbh(e);
    _mm256_mask_storeu_epi16(weights + i, mask(i), reinterpret_cast<const __m256i&>(w));
  }
  std::fill(weights + n, weights + width, uint16_t{0});
  return _mm512_reduce_add_ps(total);
}

// out[0:n] = round_to_bf16(x[0:n] * scale), n a multiple of 16.
inline void scale_to_bf16(const float* x, int64_t n, float scale, uint16_t* out) {
  for (int64_t i = 0; i < n; i += 16) {
    const __m256bh v = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(x + i), _mm512_set1_ps(scale)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), reinterpret_cast<const __m256i&>(v));
  }
}

// One extend task (cpu_layer_ops::ExtendTask) against a bf16 cache: its queries come from io.q
// (scaled and rounded to bf16 here), its outputs go to io.out.
void extend_amx(const cpu_layer_ops::AttentionIo& io, const cpu_layer_ops::ExtendTask& task, const int64_t* slots,
                const c10::BFloat16* kp, const c10::BFloat16* vp, cpu_layer_ops::AttentionScratch& s) {
  using cpu_amx::kRows;
  const int64_t group = io.heads / io.kv_heads, dim = io.dim, tokens = task.tokens, first = task.keys - tokens;
  const int64_t queries = tokens * group, padded = (queries + kRows - 1) / kRows * kRows, len = task.keys;
  const int64_t ld = (len + kAmxValueStep - 1) / kAmxValueStep * kAmxValueStep, slabs = dim / 32;
  const int64_t head_offset = task.kv_head * io.head_stride, slot_stride = io.slot_stride;
  auto seen = [&](int64_t j) { return first + j / group + 1; };  // keys query j attends over
  auto key_row = [&](const c10::BFloat16* cache, int64_t t) { return cache + slots[t] * slot_stride + head_offset; };

  s.queries16.resize(padded * dim);  // query j = token j / group, head j % group of the KV head's group
  for (int64_t i = 0; i < tokens; ++i)
    scale_to_bf16(io.q + (task.token0 + i) * io.q_stride + task.kv_head * group * dim, group * dim, io.scale,
                  s.queries16.data() + i * group * dim);
  std::fill(s.queries16.begin() + queries * dim, s.queries16.end(), uint16_t{0});
  s.key_pairs.resize(ld * dim / 2);  // per 16-key tile and 32-dim slab, a [16 words][16 keys] B tile
  for (int64_t t = 0; t < ld; t += kAmxKeyTile) {
    const uint32_t* rows[kAmxKeyTile];
    const int64_t count = std::clamp<int64_t>(len - t, 0, kAmxKeyTile);
    for (int64_t i = 0; i < count; ++i) rows[i] = reinterpret_cast<const uint32_t*>(key_row(kp, t + i));
    for (int64_t slab = 0; slab < slabs; ++slab)
      transpose_words(rows, count, slab * 16, s.key_pairs.data() + (t / kAmxKeyTile * slabs + slab) * 256);
  }
  s.value_pairs.resize(ld / 2 * dim);  // per pair of keys, their rows interleaved
  for (int64_t t = 0; t < ld; t += 2)
    interleave_rows(t < len ? &key_row(vp, t)->x : nullptr, t + 1 < len ? &key_row(vp, t + 1)->x : nullptr, dim,
                    s.value_pairs.data() + t / 2 * dim);

  // Scores: tiles 0 and 7 accumulate two key tiles, 2-5 hold the query tile's slabs, 1 and 6 K^T.
  // Weighted values: 0-3 accumulate 64 dims, 4 holds weights, 5 and 6 take V in turn.
  const int tiles[8] = {kRows, kRows, kRows, kRows, kRows, kRows, kRows, kRows};
  cpu_amx::configure_tiles(tiles);
  s.scores.resize(kRows * ld);  // one query tile's scores, then its weights
  s.weights16.assign(kRows * ld, 0);
  s.values.resize(kRows * dim);
  float* out = io.out + task.token0 * io.out_stride + task.kv_head * group * dim;
  for (int64_t q0 = 0; q0 < padded; q0 += kRows) {
    const int64_t rows = std::min<int64_t>(kRows, queries - q0), keys = seen(q0 + rows - 1);
    const int64_t width = (keys + kAmxValueStep - 1) / kAmxValueStep * kAmxValueStep;
    float* scores = s.scores.data();
    const uint16_t* q = s.queries16.data() + q0 * dim;
    _tile_loadd(2, q, dim * 2);
    if (slabs > 1) _tile_loadd(3, q + 32, dim * 2);
    if (slabs > 2) _tile_loadd(4, q + 64, dim * 2);
    if (slabs > 3) _tile_loadd(5, q + 96, dim * 2);
    for (int64_t t = 0; t < keys; t += 2 * kAmxKeyTile) {  // two key tiles a step: two chains of products
      const uint32_t* kt = s.key_pairs.data() + t / kAmxKeyTile * slabs * 256;
      const uint32_t* next = kt + slabs * 256;
      _tile_zero(0);
      _tile_zero(7);
      for (int64_t slab = 0; slab < slabs; ++slab) {
        _tile_loadd(1, kt + slab * 256, 64);
        _tile_loadd(6, next + slab * 256, 64);
        switch (slab) {  // tile numbers are immediates
          case 0: _tile_dpbf16ps(0, 2, 1); _tile_dpbf16ps(7, 2, 6); break;
          case 1: _tile_dpbf16ps(0, 3, 1); _tile_dpbf16ps(7, 3, 6); break;
          case 2: _tile_dpbf16ps(0, 4, 1); _tile_dpbf16ps(7, 4, 6); break;
          default: _tile_dpbf16ps(0, 5, 1); _tile_dpbf16ps(7, 5, 6); break;
        }
      }
      _tile_stored(0, scores + t, ld * 4);
      _tile_stored(7, scores + t + kAmxKeyTile, ld * 4);
    }
    float totals[kRows];
    for (int64_t j = 0; j < rows; ++j) totals[j] = exp_to_bf16(scores + j * ld, seen(q0 + j), width, s.weights16.data() + j * ld);
    for (int64_t d0 = 0; d0 < dim; d0 += 64) {
      const bool wide = dim - d0 >= 64;  // 4 tiles of 16 dims, else 2
      _tile_zero(0);
      _tile_zero(1);
      if (wide) {
        _tile_zero(2);
        _tile_zero(3);
      }
      for (int64_t t = 0; t < keys; t += kAmxValueStep) {
        const uint32_t* v = s.value_pairs.data() + t / 2 * dim + d0;
        _tile_loadd(4, s.weights16.data() + t, ld * 2);
        _tile_loadd(5, v, dim * 4);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, v + 16, dim * 4);
        _tile_dpbf16ps(1, 4, 6);
        if (wide) {
          _tile_loadd(5, v + 32, dim * 4);
          _tile_dpbf16ps(2, 4, 5);
          _tile_loadd(6, v + 48, dim * 4);
          _tile_dpbf16ps(3, 4, 6);
        }
      }
      float* o = s.values.data() + d0;
      _tile_stored(0, o, dim * 4);
      _tile_stored(1, o + 16, dim * 4);
      if (wide) {
        _tile_stored(2, o + 32, dim * 4);
        _tile_stored(3, o + 48, dim * 4);
      }
    }
    for (int64_t j = 0; j < rows; ++j) {
      float* row = out + (q0 + j) / group * io.out_stride + (q0 + j) % group * dim;
      const float inv = 1.f / totals[j];
      for (int64_t d = 0; d < dim; ++d) row[d] = s.values[j * dim + d] * inv;
    }
  }
}
#endif

template <typename E>
using ExtendFloat = void (*)(const float*, int64_t, int64_t, int64_t, const E*, const E*, const int64_t*, int64_t,
                             int64_t, float*, float*, float*, int64_t);

// The extend kernel for this head_dim, or nullptr (head_dim not 32, 64, 80, 96 or 128; no AVX).
template <typename E>
ExtendFloat<E> extend_float_for(int64_t dim) {
#if defined(__AVX__)
  switch (dim) {
    case 32: return extend_float<4, E>;
    case 64: return extend_float<8, E>;
    case 80: return extend_float<10, E>;
    case 96: return extend_float<12, E>;
    case 128: return extend_float<16, E>;
  }
#endif
  (void)dim;
  return nullptr;
}

}  // namespace

namespace cpu_layer_ops {

template <typename E>
void DecodeAttention::run_task(int64_t task, const E* k_cache, const E* v_cache, AttentionScratch& s) const {
  const int64_t b = task / io.kv_heads, kh = task % io.kv_heads, len = seq_lens[b];
  const int64_t group = io.heads / io.kv_heads, dim = io.dim, head_offset = kh * io.head_stride;
  const int64_t* slots = io.table + rows[b] * io.table_stride;
  const float* q = io.q + b * io.q_stride + kh * group * dim;
  float* out = io.out + b * io.out_stride + kh * group * dim;
  const AttendFloat<E> fast = attend_float_for<E>(dim);
  if (fast == nullptr) {
    decode_task_generic<float, E>(q, k_cache, v_cache, slots, len, io.slot_stride, head_offset, group, dim,
                                      io.scale, 1.f, out, s);
    return;
  }
  s.scores.assign(group * len, 0.f);
  s.queries.resize(group * dim);
  for (int64_t i = 0; i < group * dim; ++i) s.queries[i] = q[i] * io.scale;
  fast(s.queries.data(), group, k_cache, v_cache, KvRows{slots, len, head_offset}, io.slot_stride, s.scores.data(),
       out, dim);
}

// Whether extend tasks over a cache of this kind run on AMX tiles (extend_amx).
bool extend_on_amx(bool bf16_cache, int64_t dim) {
#if RADIXSERVE_AMX
  return bf16_cache && dim % 32 == 0 && dim <= 128 && cpu_amx::amx_ready();
#else
  (void)bf16_cache, (void)dim;
  return false;
#endif
}

// Tasks costliest first; threads take the next one as they finish (causal blocks differ in cost,
// so a static split would leave one thread with the long ones). An AMX task takes more tokens:
// it transforms its keys and values once for all of them.
ExtendAttention plan_extend_attention(const AttentionIo& io, const int64_t* rows, const int64_t* prefix,
                                      const int64_t* extend, int64_t batch, bool bf16_cache) {
  TORCH_CHECK(extend_float_for<float>(io.dim) != nullptr, "extend kernel: unsupported head dim ", io.dim);
  const bool amx = extend_on_amx(bf16_cache, io.dim);
  const int64_t block = amx ? kAmxQueryBlock : kQueryBlock;
  std::vector<ExtendTask> tasks;
  for (int64_t b = 0, token0 = 0; b < batch; token0 += extend[b], ++b)
    for (int64_t i = 0; i < extend[b]; i += block) {
      const int64_t tokens = std::min(block, extend[b] - i);
      for (int64_t kh = 0; kh < io.kv_heads; ++kh) tasks.push_back({b, token0 + i, tokens, kh, prefix[b] + i + tokens});
    }
  std::stable_sort(tasks.begin(), tasks.end(), [](const ExtendTask& a, const ExtendTask& b) { return a.keys > b.keys; });
  return {io, rows, std::move(tasks), amx};
}

template <typename E>
void ExtendAttention::run_task(const ExtendTask& task, const E* k_cache, const E* v_cache, AttentionScratch& s) const {
  const int64_t group = io.heads / io.kv_heads, dim = io.dim;
  const int64_t* slots = io.table + rows[task.request] * io.table_stride;
#if RADIXSERVE_AMX
  if constexpr (std::is_same_v<E, c10::BFloat16>)
    if (amx) {
      extend_amx(io, task, slots, k_cache, v_cache, s);
      return;
    }
#endif
  s.queries.resize(kQueryBlock * group * dim);
  s.keys_t.resize(kKeyTile * dim);
  for (int64_t i = 0; i < task.tokens; ++i)
    for (int64_t j = 0; j < group * dim; ++j)
      s.queries[i * group * dim + j] = io.q[(task.token0 + i) * io.q_stride + task.kv_head * group * dim + j] * io.scale;
  s.scores.resize(task.tokens * group * ((task.keys + kKeyTile - 1) / kKeyTile * kKeyTile));
  extend_float_for<E>(dim)(s.queries.data(), task.tokens, group, task.keys - task.tokens, k_cache, v_cache, slots,
                        io.slot_stride, task.kv_head * io.head_stride, s.scores.data(), s.keys_t.data(),
                        io.out + task.token0 * io.out_stride + task.kv_head * group * dim, io.out_stride);
}

template void DecodeAttention::run_task(int64_t, const float*, const float*, AttentionScratch&) const;
template void DecodeAttention::run_task(int64_t, const c10::BFloat16*, const c10::BFloat16*, AttentionScratch&) const;
template void ExtendAttention::run_task(const ExtendTask&, const float*, const float*, AttentionScratch&) const;
template void ExtendAttention::run_task(const ExtendTask&, const c10::BFloat16*, const c10::BFloat16*,
                                        AttentionScratch&) const;

}  // namespace cpu_layer_ops

namespace {

// q itself when each token's heads are contiguous (tokens may follow any stride, as in a view
// into the fused QKV projection), else a contiguous copy.
torch::Tensor with_contiguous_heads(const torch::Tensor& q) {
  return q.stride(2) == 1 && q.stride(1) == q.size(2) ? q : q.contiguous();
}

}  // namespace

// q [B, H, D] (a token's heads contiguous; tokens may follow any stride); k_cache, v_cache [slots, KVH, D]
// of q's dtype, or uint8 holding FP8 (float8_e4m3fn) K / k_scale and V / v_scale; req_to_token [rows,
// max_len] int64; rows, seq_lens [B] int64.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor req_to_token, torch::Tensor rows, torch::Tensor seq_lens,
                                     double scale, double k_scale, double v_scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "q and caches must be 3-d");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(k_cache.stride(2) == 1 && v_cache.stride(2) == 1 && k_cache.strides() == v_cache.strides(),
              "caches must share a layout with contiguous head dims");
  q = with_contiguous_heads(q);
  if (q.scalar_type() == torch::kBFloat16 && k_cache.scalar_type() == torch::kBFloat16 &&
      v_cache.scalar_type() == torch::kBFloat16) {  // the float32 fast path, its queries widened
    const auto q32 = q.to(torch::kFloat);
    auto out32 = torch::empty(q32.sizes(), q32.options());
    decode_kernel<float, c10::BFloat16>(q32, k_cache, v_cache, req_to_token.contiguous(), rows.contiguous(),
                                        seq_lens.contiguous(), out32, scale, 1.0, 1.0);
    return out32.to(torch::kBFloat16);
  }
  auto out = torch::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  const bool fp8 = k_cache.scalar_type() == torch::kByte;
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type() && (fp8 || k_cache.scalar_type() == q.scalar_type()),
              "caches must have q's dtype, or be uint8 (FP8)");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    if (fp8)
      decode_kernel<scalar_t, uint8_t>(q, k_cache, v_cache, req_to_token.contiguous(), rows.contiguous(),
                                       seq_lens.contiguous(), out, scale, k_scale, v_scale);
    else
      decode_kernel<scalar_t, scalar_t>(q, k_cache, v_cache, req_to_token.contiguous(), rows.contiguous(),
                                        seq_lens.contiguous(), out, scale, 1.0, 1.0);
  });
  return out;
}

// q [T, H, D] float32, or bf16 with bf16 caches (strided as for decode): request b's extend_lens[b] new tokens follow request b-1's, and token i of
// request b is at position prefix_lens[b] + i; its K/V is already stored in the pool.
// k_cache, v_cache [slots, KVH, D]; req_to_token [rows, max_len] int64; rows, prefix_lens,
// extend_lens [B] int64. Head dims 32, 64, 80, 96 or 128 (`extend_supported`).
torch::Tensor paged_extend_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor req_to_token, torch::Tensor rows, torch::Tensor prefix_lens,
                                     torch::Tensor extend_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "q and caches must be 3-d");
  const bool bf16 = k_cache.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type() && (bf16 || k_cache.scalar_type() == torch::kFloat) &&
                  q.scalar_type() == k_cache.scalar_type(),
              "extend kernel: q and caches all float32 or all bf16");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(k_cache.stride(2) == 1 && v_cache.stride(2) == 1 && k_cache.strides() == v_cache.strides(),
              "caches must share a layout with contiguous head dims");
  q = bf16 ? with_contiguous_heads(q).to(torch::kFloat) : with_contiguous_heads(q);
  req_to_token = req_to_token.contiguous();
  rows = rows.contiguous(), prefix_lens = prefix_lens.contiguous(), extend_lens = extend_lens.contiguous();
  const int64_t batch = rows.size(0), heads = q.size(1), dim = q.size(2);
  TORCH_CHECK(extend_lens.sum().item<int64_t>() == q.size(0), "extend_lens must add up to q's tokens");
  auto out = torch::empty({q.size(0), heads, dim}, q.options());
  const auto attention = cpu_layer_ops::plan_extend_attention(
      {q.data_ptr<float>(), q.stride(0), k_cache.stride(0), k_cache.stride(1), req_to_token.data_ptr<int64_t>(), req_to_token.stride(0), out.data_ptr<float>(), heads * dim,
       heads, k_cache.size(1), dim, static_cast<float>(scale)},
      rows.data_ptr<int64_t>(), prefix_lens.data_ptr<int64_t>(), extend_lens.data_ptr<int64_t>(), batch, bf16);
  auto run = [&](auto kp, auto vp) {
    std::atomic<size_t> next{0};
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
      cpu_layer_ops::AttentionScratch scratch;
      for (size_t n = next++; n < attention.tasks.size(); n = next++) attention.run_task(attention.tasks[n], kp, vp, scratch);
    });
  };
  if (!bf16) {
    run(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
    return out;
  }
  run(k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>());
  return out.to(torch::kBFloat16);
}

bool extend_supported(int64_t head_dim) { return extend_float_for<float>(head_dim) != nullptr; }

void bind_cpu_attention(pybind11::module& m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention over the KV pool (CPU)",
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("req_to_token"),
        pybind11::arg("rows"), pybind11::arg("seq_lens"), pybind11::arg("scale"), pybind11::arg("k_scale") = 1.0,
        pybind11::arg("v_scale") = 1.0);
  m.def("paged_extend_attention", &paged_extend_attention, "paged causal attention of new tokens after a prefix (CPU)");
  m.def("extend_supported", &extend_supported, "whether paged_extend_attention has a kernel for this head dim");
}
