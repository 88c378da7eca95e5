// y = x W^T + b against a weight packed once into column blocks, for the CPU forward: a float32
// weight, or a bf16 one (below) whose products accumulate in float32.
//
// Packed layout: column blocks of kBlock outputs (block b holds columns b*kBlock .., zero-padded
// past N), stored in the order the kernel reads them: [group of kGroup blocks][k chunk][block of
// the group][k of the chunk][kBlock]. A micro-kernel keeps a tile of Rows rows x Blocks blocks in
// kAcc vector accumulators and streams each of its blocks once per k: contiguous weight reads, no
// horizontal sums. On AVX2 every tile shape uses all kAcc accumulators (6 rows x 1 block, 3 x 2,
// 2 x 3, 1 x 6), so the FMA units stay busy at any row count: a 4-row tile over one block would
// leave half of them waiting on the FMA latency; AVX-512's 24 leave room for any height (see
// next_height). Threads take units of blocks from the two ends of the range (cpu_parallel.h),
// so each streams through the weight in one direction (decode is bound by that stream). Rows
// are taken kRowChunk at a time so that chunk of x stays in L2, and k kChunk at a time so a
// group's slice of the weight stays in cache across the row tiles; fewer chunks are fewer passes
// that reload a tile's accumulators. The measurements behind each choice: bench/results/cpu.md.
//
// A bf16 weight is packed the same way with each 32-bit element holding a pair of bf16 weights
// of neighbouring k (the even one in the low half), and the GEMM reads its input rows as bf16
// pairs too: where the CPU has AVX512-BF16 one dot-product instruction multiplies and adds a
// vector of pairs (twice the float32 FMA's products, half its weight bytes); elsewhere each
// half is widened to float32 for two FMAs.
//
// On a CPU with AMX-BF16 the bf16 GEMM runs every row through AMX instead: the packed layout is
// already the one AMX multiplies (a block's k-pair rows of kBlock words, two 16-column B tiles
// side by side), so a 32-row x 32-column tile of outputs is 4 accumulator tiles, fed by two A
// tiles of up to 16 input rows each and the block's two B tiles, 16 pairs of k at a time; what
// does not fill B tiles (a partial last block, k pairs past the last 16) takes the vector kernel.
#include <torch/extension.h>
#include "cpu_bindings.h"
#include <ATen/Parallel.h>
#include <array>
#include <cstring>
#include <utility>
#include "cpu_layer_ops.h"
#include "cpu_parallel.h"
#include "cpu_amx.h"
#include "cpu_simd.h"

namespace {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kAcc = 24;  // accumulators, of the 32 vector registers
#else
constexpr int kLanes = 8;
constexpr int kAcc = 12;  // accumulators, of the 16 vector registers
#endif
constexpr int kVecs = 2;
constexpr int kBlock = kLanes * kVecs;
constexpr int kGroup = kAcc / kVecs;  // blocks a one-row tile covers; also the tallest tile's rows
constexpr int64_t kChunk = 768;
// Blocks of a unit of work (see packed_linear): a group on AVX2, half a group on AVX-512 (whose
// groups are 12 blocks), so that the model's small projections (36 blocks) still make 6 units.
constexpr int64_t kUnitBlocks = 6;
static_assert(kGroup % kUnitBlocks == 0, "a group must hold whole units");
constexpr int64_t kRowChunk = 96;
// Up to kStreamRows rows (decode batches), a tile of kStreamTileRows or more rows reading its
// blocks for the first time prefetches the blocks its thread reads next (every cache line of
// them; see packed_linear), so that the weight stream overlaps the arithmetic (measured faster
// only in these tiles: bench/results/cpu.md). The hint's cache level is kPrefetchLocality
// (cpu_simd.h): L2 on AVX-512, every level on AVX2.
constexpr int64_t kStreamRows = 32;
constexpr int kStreamTileRows = 6;

typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef uint32_t Words __attribute__((vector_size(kLanes * sizeof(uint32_t))));

inline Vec load(const float* p) { Vec v; std::memcpy(&v, p, sizeof(Vec)); return v; }
inline void store(float* p, Vec v) { std::memcpy(p, &v, sizeof(Vec)); }

template <typename To, typename From>
inline To bits_as(From v) { static_assert(sizeof(To) == sizeof(From)); To out; std::memcpy(&out, &v, sizeof(To)); return out; }

// The 32-bit word at p (a pair of bf16) in every lane, copied as bits: a float broadcast could
// flush a pair whose high half is zero as a denormal.
inline Vec broadcast_pair(const float* p) {
  uint32_t word;
  std::memcpy(&word, p, sizeof(word));
  return bits_as<Vec>(Words{} + word);
}

// acc + w.even * x.even + w.odd * x.odd, lane by lane, for vectors of bf16 pairs w and x.
inline Vec dot_pairs(Vec acc, Vec w, Vec x) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  return Vec(_mm512_dpbf16_ps(__m512(acc), bits_as<__m512bh>(w), bits_as<__m512bh>(x)));
#elif defined(__AVX512BF16__) && defined(__AVX512VL__)
  return Vec(_mm256_dpbf16_ps(__m256(acc), bits_as<__m128bh>(w), bits_as<__m128bh>(x)));
#else
  const Words wi = bits_as<Words>(w), xi = bits_as<Words>(x), high = Words{} + 0xffff0000u;
  return acc + bits_as<Vec>(wi << 16) * bits_as<Vec>(xi << 16) + bits_as<Vec>(wi & high) * bits_as<Vec>(xi & high);
#endif
}

// x rounded to the nearest bf16 (ties to even).
inline uint16_t to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// A row of a block's outputs (cols <= kBlock of them) as kVecs vectors, zero past cols.
inline void load_row(const float* p, int64_t cols, Vec* out) {
  if (cols == kBlock) {  // a whole block: straight vector loads (the padded copy calls memcpy)
    for (int v = 0; v < kVecs; ++v) out[v] = load(p + v * kLanes);
    return;
  }
  float padded[kBlock] = {};
  std::memcpy(padded, p, cols * sizeof(float));
  for (int v = 0; v < kVecs; ++v) out[v] = load(padded + v * kLanes);
}

inline void store_row(float* p, int64_t cols, const Vec* in) {
  if (cols == kBlock) {
    for (int v = 0; v < kVecs; ++v) store(p + v * kLanes, in[v]);
    return;
  }
  float padded[kBlock];
  for (int v = 0; v < kVecs; ++v) store(padded + v * kLanes, in[v]);
  std::memcpy(p, padded, cols * sizeof(float));
}

struct Tile {
  const float* x;      // first row of the tile
  int64_t ldx;
  const float* block;  // the tile's first packed block, [K, kBlock]; the next ones follow
  int64_t block_stride;
  const float* bias;   // the first block's bias, or nullptr
  int64_t k0, k1;      // the k range of this pass; k0 == 0 starts from the bias (or zero)
  float* y;            // first row, first column of the tile's outputs
  int64_t ldy;
  int64_t cols;        // valid columns from the first block on (only the last block is partial)
  const float* prefetch;  // the block read next, addressed like `block` (see kStreamRows), or nullptr
};

inline int64_t block_cols(const Tile& t, int j) { return std::min<int64_t>(kBlock, t.cols - j * kBlock); }

// Bf16: x and the blocks hold bf16 pairs (see the top), k counts pairs.
template <int Rows, int Blocks, bool Bf16>
void micro(const Tile& t) {
  Vec acc[Rows][Blocks][kVecs];
  for (int m = 0; m < Rows; ++m)
    for (int j = 0; j < Blocks; ++j) {
      if (t.k0 > 0) load_row(t.y + m * t.ldy + j * kBlock, block_cols(t, j), acc[m][j]);
      else if (t.bias != nullptr) load_row(t.bias + j * kBlock, block_cols(t, j), acc[m][j]);
      else for (int v = 0; v < kVecs; ++v) acc[m][j][v] = Vec{};
    }
#pragma GCC unroll 4  // measured: ~10% more FLOP/s at prefill sizes than the plain loop
  for (int64_t k = t.k0; k < t.k1; ++k) {
    if (Rows >= kStreamTileRows && t.prefetch != nullptr)
      for (int j = 0; j < Blocks; ++j)
        for (int line = 0; line < kBlock; line += 64 / static_cast<int>(sizeof(float)))
          __builtin_prefetch(t.prefetch + j * t.block_stride + k * kBlock + line, 0, kPrefetchLocality);
    if constexpr (Bf16 && Rows <= Blocks * kVecs) {
      Vec xv[Rows];
      for (int m = 0; m < Rows; ++m) xv[m] = broadcast_pair(t.x + m * t.ldx + k);
      for (int j = 0; j < Blocks; ++j)
        for (int v = 0; v < kVecs; ++v) {
          const Vec w = load(t.block + j * t.block_stride + k * kBlock + v * kLanes);
          for (int m = 0; m < Rows; ++m) acc[m][j][v] = dot_pairs(acc[m][j][v], w, xv[m]);
        }
    } else if constexpr (Bf16) {
      Vec w[Blocks][kVecs];
      for (int j = 0; j < Blocks; ++j)
        for (int v = 0; v < kVecs; ++v) w[j][v] = load(t.block + j * t.block_stride + k * kBlock + v * kLanes);
      for (int m = 0; m < Rows; ++m) {
        const Vec xv = broadcast_pair(t.x + m * t.ldx + k);
        for (int j = 0; j < Blocks; ++j)
          for (int v = 0; v < kVecs; ++v) acc[m][j][v] = dot_pairs(acc[m][j][v], w[j][v], xv);
      }
    } else if constexpr (Rows <= Blocks * kVecs) {  // fewer x values than weight vectors: hold x in registers
      Vec xv[Rows];
      for (int m = 0; m < Rows; ++m) xv[m] = Vec{} + t.x[m * t.ldx + k];
      for (int j = 0; j < Blocks; ++j)
        for (int v = 0; v < kVecs; ++v) {
          const Vec w = load(t.block + j * t.block_stride + k * kBlock + v * kLanes);
          for (int m = 0; m < Rows; ++m) acc[m][j][v] += w * xv[m];
        }
    } else {  // hold the weight vectors, broadcast each x value as it is used
      Vec w[Blocks][kVecs];
      for (int j = 0; j < Blocks; ++j)
        for (int v = 0; v < kVecs; ++v) w[j][v] = load(t.block + j * t.block_stride + k * kBlock + v * kLanes);
      for (int m = 0; m < Rows; ++m) {
        const float xv = t.x[m * t.ldx + k];
        for (int j = 0; j < Blocks; ++j)
          for (int v = 0; v < kVecs; ++v) acc[m][j][v] += w[j][v] * xv;
      }
    }
  }
  for (int m = 0; m < Rows; ++m)
    for (int j = 0; j < Blocks; ++j) store_row(t.y + m * t.ldy + j * kBlock, block_cols(t, j), acc[m][j]);
}

using Micro = void (*)(const Tile&);

// kMicro[rows - 1][blocks - 1] for rows <= kGroup, blocks <= kGroup / rows (other entries unused);
// kMicroBf16 likewise for bf16 weights.
template <bool Bf16, int Rows, int... B>
constexpr std::array<Micro, kGroup> micro_row(std::integer_sequence<int, B...>) {
  return {(B < kGroup / Rows ? &micro<Rows, (B < kGroup / Rows ? B + 1 : 1), Bf16> : nullptr)...};
}
template <bool Bf16, int... R>
constexpr std::array<std::array<Micro, kGroup>, kGroup> micro_table(std::integer_sequence<int, R...>) {
  return {micro_row<Bf16, R + 1>(std::make_integer_sequence<int, kGroup>{})...};
}
constexpr auto kMicro = micro_table<false>(std::make_integer_sequence<int, kGroup>{});
constexpr auto kMicroBf16 = micro_table<true>(std::make_integer_sequence<int, kGroup>{});

// Tile heights for a chunk of rows: full kGroup-row tiles, then, on AVX2, heights that divide
// kGroup (so that their tiles also fill kAcc accumulators), tallest first. On AVX-512 the rest
// is one tile height, so that every row count under kGroup reads each block once: a tile of
// rows x (kGroup / rows) blocks keeps at least 14 of its 24 accumulators busy, enough for the
// FMA latency, where a second, shorter pass (8 rows as 6 + 2) re-read the blocks from L2 with
// the weight stream idle. Measured on a 2-core Zen 5, decode steps interleaved in one process:
// batch 8 0.85-0.91x the time, batch 7 0.85-0.93x, 11 0.70-0.78x, 5 0.93-1.00x.
int next_height(int64_t rows) {
  if (rows >= kGroup) return kGroup;
#if defined(__AVX512F__)
  return static_cast<int>(rows);
#else
  for (int h = static_cast<int>(rows); h > 1; --h)
    if (kGroup % h == 0) return h;
  return 1;
#endif
}

#if RADIXSERVE_AMX
using cpu_amx::kPairs;
using cpu_amx::kRows;
static_assert(kBlock == 32, "AMX: a block is two 16-column B tiles");

// Tiles 0-3 accumulate C (rows 0-15 / 16-31 x columns 0-15 / 16-31 of a block), 4-5 hold A (the
// two row halves), 6-7 B (the block's two 16-column halves). The first half has `upper` rows,
// the second `lower` (fewer than 16 at the end of a row chunk).
void configure_gemm_tiles(int upper, int lower) {
  cpu_amx::configure_tiles({upper, upper, lower, lower, upper, lower, kPairs, kPairs});
}

// The outputs of Halves row halves (configure_tiles) x one block, over the block's first `pairs`
// k pairs of a chunk: started from the bias (a row repeated: stride 0) or zero at the first
// chunk, else from y.
template <int Halves>
void amx_block(const uint16_t* x16, int64_t ldx, const float* block, const float* bias, bool first_chunk, float* y,
               int64_t ldy, int64_t pairs) {
  const int64_t ldy_bytes = ldy * sizeof(float), ldx_bytes = ldx * sizeof(uint16_t);
  if (!first_chunk) {
    _tile_loadd(0, y, ldy_bytes);
    _tile_loadd(1, y + 16, ldy_bytes);
    if (Halves == 2) {
      _tile_loadd(2, y + kRows * ldy, ldy_bytes);
      _tile_loadd(3, y + kRows * ldy + 16, ldy_bytes);
    }
  } else if (bias != nullptr) {
    _tile_loadd(0, bias, 0);
    _tile_loadd(1, bias + 16, 0);
    if (Halves == 2) {
      _tile_loadd(2, bias, 0);
      _tile_loadd(3, bias + 16, 0);
    }
  } else {
    _tile_zero(0);
    _tile_zero(1);
    if (Halves == 2) {
      _tile_zero(2);
      _tile_zero(3);
    }
  }
  for (int64_t p = 0; p < pairs; p += kPairs) {
    _tile_loadd(6, block + p * kBlock, kBlock * sizeof(float));
    _tile_loadd(7, block + p * kBlock + 16, kBlock * sizeof(float));
    _tile_loadd(4, x16 + 2 * p, ldx_bytes);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (Halves == 2) {
      _tile_loadd(5, x16 + 2 * p + kRows * ldx, ldx_bytes);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, y, ldy_bytes);
  _tile_stored(1, y + 16, ldy_bytes);
  if (Halves == 2) {
    _tile_stored(2, y + kRows * ldy, ldy_bytes);
    _tile_stored(3, y + kRows * ldy + 16, ldy_bytes);
  }
}
#endif

}  // namespace

// A float32 [out, in] weight as packed float32; a bf16 one (even `in`) as packed bf16 pairs,
// [blocks, in / 2, 2 * kBlock] bf16.
torch::Tensor pack_linear_weight(const torch::Tensor& weight) {
  const bool bf16 = weight.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(weight.dim() == 2 && (bf16 || weight.scalar_type() == torch::kFloat),
              "weight must be [out, in] float32 or bfloat16");
  TORCH_CHECK(!bf16 || weight.size(1) % 2 == 0, "a bfloat16 weight needs an even number of inputs");
  // Packed as 32-bit elements: floats, or pairs of bf16 along k.
  const auto words = bf16 ? weight.contiguous().view(torch::kInt) : weight.view(torch::kInt);
  const int64_t n = words.size(0), k = words.size(1), blocks = (n + kBlock - 1) / kBlock;
  auto padded = torch::zeros({blocks * kBlock, k}, words.options());
  padded.narrow(0, 0, n).copy_(words);
  auto bk = padded.view({blocks, kBlock, k}).transpose(1, 2).contiguous();  // [blocks, K, kBlock]
  auto out = torch::empty({blocks, k, kBlock}, words.options());
  int32_t* o = out.data_ptr<int32_t>();
  const int32_t* src = bk.data_ptr<int32_t>();
  for (int64_t g = 0; g < blocks; g += kGroup) {
    const int64_t group = std::min<int64_t>(kGroup, blocks - g);
    for (int64_t k0 = 0; k0 < k; k0 += kChunk) {
      const int64_t kc = std::min(kChunk, k - k0);
      for (int64_t b = g; b < g + group; ++b) {
        std::memcpy(o, src + (b * k + k0) * kBlock, kc * kBlock * sizeof(int32_t));
        o += kc * kBlock;
      }
    }
  }
  return out.view(bf16 ? torch::kBFloat16 : torch::kFloat);
}

namespace cpu_layer_ops {

PackedGemm plan_packed_gemm(const torch::Tensor& packed, const float* x, int64_t rows, int64_t k, const float* bias,
                            float* y, int64_t n, uint16_t* x16) {
  const bool bf16 = packed.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() &&
              (bf16 ? packed.size(2) == 2 * kBlock && packed.size(1) * 2 == k && (x16 != nullptr || rows == 0)
                    : packed.size(2) == kBlock && packed.size(1) == k && packed.scalar_type() == torch::kFloat),
              "packed weight does not match x (pack it with pack_linear_weight)");
  TORCH_CHECK(packed.size(0) * kBlock >= n, "more outputs than the packed weight holds");
  // Work units: kUnitBlocks blocks of outputs for a chunk of rows, rows chunk by chunk, shared by
  // the threads from both ends (cpu_parallel.h). Split evenly in advance, a slower core held the
  // other at the end of every call: the model's linear layers at 8 rows took 0.90-0.95x the time
  // of that split on a 2-core Zen 1 (interleaved runs), whose two cores ran the same share up to
  // 1.3x apart.
  const int64_t blocks = (n + kBlock - 1) / kBlock, units_per_chunk = (blocks + kUnitBlocks - 1) / kUnitBlocks;
  const int64_t row_chunks = (rows + kRowChunk - 1) / kRowChunk;
  TORCH_CHECK(row_chunks * units_per_chunk < (int64_t{1} << 31), "too many work units");  // SharedUnits' limit
  return {x, static_cast<const float*>(packed.data_ptr()), bias, y, rows, k, n, blocks, units_per_chunk,
          row_chunks * units_per_chunk, bf16 ? x16 : nullptr};
}

void PackedGemm::input_to_bf16(int64_t begin, int64_t end) const {
  for (int64_t r = begin; r < end; ++r) round_span(r, 0, k);
}

void PackedGemm::round_span(int64_t r, int64_t c0, int64_t c1) const {
  const float* in = x + r * k;
  uint16_t* out = x16 + r * k;
#pragma omp simd
  for (int64_t i = c0; i < c1; ++i) out[i] = to_bf16(in[i]);
}

void PackedGemm::run_unit(int64_t unit, bool front) const {
  // In 32-bit elements: k of them a row, or k / 2 pairs for bf16 weights.
  const bool bf16 = x16 != nullptr;
  const int64_t k = bf16 ? this->k / 2 : this->k;
  const float* x = bf16 ? reinterpret_cast<const float*>(x16) : this->x;
  const auto& table = bf16 ? kMicroBf16 : kMicro;
  // Where block b's rows [k0, k0 + kc) start in the packed layout (kc = the chunk's size).
  auto block_chunk = [&](int64_t b, int64_t k0) {
    const int64_t g = b - b % kGroup, group = std::min<int64_t>(kGroup, blocks - g);
    return w + g * k * kBlock + k0 * group * kBlock + (b - g) * std::min(kChunk, k - k0) * kBlock;
  };
  const int64_t r0 = unit / units_per_chunk * kRowChunk, r_end = std::min(rows, r0 + kRowChunk);
  const int64_t first_block = unit % units_per_chunk * kUnitBlocks;
  const int64_t last_block = std::min(blocks, first_block + kUnitBlocks);
  const int64_t next_unit = front ? unit + 1 : unit - 1;  // most likely the thread's next one
  // The block this thread reads after block b's chunk at k0: the unit's next block, the unit's
  // first block in the next chunk, or the next unit's first block; nullptr at the range's end.
  auto read_after = [&](int64_t b, int64_t k0, int64_t kc) -> const float* {
    if (b + 1 < last_block) return block_chunk(b + 1, k0);
    if (k0 + kc < k) return block_chunk(first_block, k0 + kc);
    if (next_unit < 0 || next_unit >= units) return nullptr;
    return block_chunk(next_unit % units_per_chunk * kUnitBlocks, 0);
  };
  // The vector kernel over rows [ra, rb) x blocks [ba, bb) of the chunk at k0, from its pair k0 + skip on.
  auto vector_tiles = [&](int64_t ra, int64_t rb, int64_t ba, int64_t bb, int64_t k0, int64_t kc, int64_t skip) {
    for (int64_t r = ra; r < rb;) {
      const int height = next_height(rb - r);
      const int64_t span = kGroup / height;
      for (int64_t b = ba; b < bb; b += span) {
        const int64_t count = std::min(span, bb - b);
        const float* after = r == r0 && rows <= kStreamRows ? read_after(b + count - 1, k0, kc) : nullptr;
        const Tile tile{x + r * k, k, block_chunk(b, k0) - k0 * kBlock, kc * kBlock, bias ? bias + b * kBlock : nullptr,
                        k0 + skip, k0 + kc, y + r * n + b * kBlock, n, n - b * kBlock,
                        after != nullptr ? after - k0 * kBlock : nullptr};
        table[height - 1][count - 1](tile);
      }
      r += height;
    }
  };
  for (int64_t k0 = 0; k0 < k; k0 += kChunk) {
    const int64_t kc = std::min(kChunk, k - k0);
#if RADIXSERVE_AMX
    // Every row through AMX, over the blocks whose columns are all outputs and the k pairs that
    // fill tiles; the vector kernel does the rest of the columns and pairs. Each output is one
    // row's sum whatever the other rows, as in the vector kernel: a row's bits do not depend
    // on the batch (deterministic inference relies on it).
    const int64_t full_end = std::min(last_block, n / kBlock), pairs = kc / kPairs * kPairs;
    if (bf16 && full_end > first_block && pairs > 0 && cpu_amx::amx_ready()) {
      for (int64_t rr = r0; rr < r_end; rr += 2 * kRows) {
        const int64_t upper = std::min<int64_t>(kRows, r_end - rr), lower = std::min<int64_t>(kRows, r_end - rr - upper);
        configure_gemm_tiles(upper, lower);
        for (int64_t b = first_block; b < full_end; ++b)
          (lower > 0 ? amx_block<2> : amx_block<1>)(x16 + rr * this->k + 2 * k0, this->k, block_chunk(b, k0),
                                                    bias ? bias + b * kBlock : nullptr, k0 == 0, y + rr * n + b * kBlock,
                                                    n, pairs);
      }
      if (pairs < kc) vector_tiles(r0, r_end, first_block, full_end, k0, kc, pairs);
      vector_tiles(r0, r_end, full_end, last_block, k0, kc, 0);
      continue;
    }
#endif
    vector_tiles(r0, r_end, first_block, last_block, k0, kc, 0);
  }
}

}  // namespace cpu_layer_ops

// x [rows, in] float32 against a float32 packed weight, or float32 or bf16 against a bf16 one;
// y in x's dtype.
torch::Tensor packed_linear(const torch::Tensor& x_in, const torch::Tensor& packed,
                            const c10::optional<torch::Tensor>& bias_in, int64_t n) {
  const bool bf16_weight = packed.scalar_type() == torch::kBFloat16, bf16_x = x_in.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(x_in.dim() == 2 && (x_in.scalar_type() == torch::kFloat || (bf16_x && bf16_weight)),
              "x must be [rows, in] float32, or bfloat16 against a bfloat16 weight");
  const auto x = x_in.contiguous();
  const auto bias = bias_in.has_value() ? c10::optional<torch::Tensor>(bias_in->to(torch::kFloat).contiguous()) : bias_in;
  auto y = torch::empty({x.size(0), n}, x.options().dtype(torch::kFloat));
  torch::Tensor x16 = bf16_x ? x : torch::empty({bf16_weight ? x.size(0) : 0, x.size(1)}, x.options().dtype(torch::kBFloat16));
  const float* x32 = bf16_x ? nullptr : x.data_ptr<float>();
  const auto gemm = cpu_layer_ops::plan_packed_gemm(packed, x32, x.size(0), x.size(1),
                                                     bias.has_value() ? bias->data_ptr<float>() : nullptr,
                                                     y.data_ptr<float>(), n, static_cast<uint16_t*>(x16.data_ptr()));
  if (bf16_weight && !bf16_x)
    at::parallel_for(0, x.size(0), 16, [&](int64_t begin, int64_t end) { gemm.input_to_bf16(begin, end); });
  cpu_parallel::for_units_from_both_ends(gemm.units, [&](int64_t unit, bool front) { gemm.run_unit(unit, front); });
  return bf16_x ? y.to(torch::kBFloat16) : y;
}

void bind_cpu_linear(pybind11::module& m) {
  m.def("pack_linear_weight", &pack_linear_weight, "pack an [out, in] float32 or bfloat16 weight for packed_linear");
  m.def("packed_linear", &packed_linear, "x W^T + b against a packed float32 or bfloat16 weight");
}
