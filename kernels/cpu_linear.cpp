// float32 y = x W^T + b against a weight packed once into column blocks, for the CPU forward.
//
// Packed layout: [blocks, K, kBlock], block b holding output columns b*kBlock .. b*kBlock+kBlock-1
// (zero-padded past N). A micro-kernel keeps a tile of up to kMaxRows rows x kBlock columns in
// vector registers and streams its block once per k: one contiguous weight read per step, no
// horizontal sums. Threads split the column blocks, so each streams its own contiguous part of
// the weight (decode is bound by that stream). Rows are taken kRowChunk at a time so that chunk
// of x stays in L2, and k kChunk at a time so a block's slice stays in L1 across the row tiles.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <array>
#include <cstring>
#include <utility>

namespace {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kMaxRows = 12;  // 24 accumulators of the 32 vector registers
#else
constexpr int kLanes = 8;
constexpr int kMaxRows = 6;   // 12 accumulators of the 16 vector registers
#endif
constexpr int kVecs = 2;
constexpr int kBlock = kLanes * kVecs;
constexpr int64_t kChunk = 256;
constexpr int64_t kRowChunk = 96;

typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));

inline Vec load(const float* p) { Vec v; std::memcpy(&v, p, sizeof(Vec)); return v; }
inline void store(float* p, Vec v) { std::memcpy(p, &v, sizeof(Vec)); }

// A row of a block's outputs (cols <= kBlock of them) as kVecs vectors, zero past cols.
inline void load_row(const float* p, int64_t cols, Vec* out) {
  float padded[kBlock] = {};
  std::memcpy(padded, p, cols * sizeof(float));
  for (int v = 0; v < kVecs; ++v) out[v] = load(padded + v * kLanes);
}

inline void store_row(float* p, int64_t cols, const Vec* in) {
  float padded[kBlock];
  for (int v = 0; v < kVecs; ++v) store(padded + v * kLanes, in[v]);
  std::memcpy(p, padded, cols * sizeof(float));
}

struct Tile {
  const float* x;      // first row of the tile
  int64_t ldx;
  const float* block;  // the packed block, [K, kBlock]
  const float* bias;   // this block's bias, or nullptr
  int64_t k0, k1;      // the k range of this pass; k0 == 0 starts from the bias (or zero)
  float* y;            // first row, first column of the tile's outputs
  int64_t ldy;
  int64_t cols;        // valid columns in this block
};

template <int Rows>
void micro(const Tile& t) {
  Vec acc[Rows][kVecs];
  for (int m = 0; m < Rows; ++m) {
    if (t.k0 > 0) load_row(t.y + m * t.ldy, t.cols, acc[m]);
    else if (t.bias != nullptr) load_row(t.bias, t.cols, acc[m]);
    else for (int v = 0; v < kVecs; ++v) acc[m][v] = Vec{};
  }
  for (int64_t k = t.k0; k < t.k1; ++k) {
    Vec w[kVecs];
    for (int v = 0; v < kVecs; ++v) w[v] = load(t.block + k * kBlock + v * kLanes);
    for (int m = 0; m < Rows; ++m) {
      const float xv = t.x[m * t.ldx + k];
      for (int v = 0; v < kVecs; ++v) acc[m][v] += w[v] * xv;
    }
  }
  for (int m = 0; m < Rows; ++m) store_row(t.y + m * t.ldy, t.cols, acc[m]);
}

template <int... Rows>
constexpr auto micro_table(std::integer_sequence<int, Rows...>) {
  return std::array<void (*)(const Tile&), sizeof...(Rows)>{micro<Rows + 1>...};
}
constexpr auto kMicro = micro_table(std::make_integer_sequence<int, kMaxRows>{});

}  // namespace

torch::Tensor pack_linear_weight(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat, "weight must be [out, in] float32");
  const int64_t n = weight.size(0), k = weight.size(1), blocks = (n + kBlock - 1) / kBlock;
  auto padded = torch::zeros({blocks * kBlock, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  return padded.view({blocks, kBlock, k}).transpose(1, 2).contiguous();
}

torch::Tensor packed_linear(const torch::Tensor& x_in, const torch::Tensor& packed,
                            const c10::optional<torch::Tensor>& bias, int64_t n) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == torch::kFloat, "x must be [rows, in] float32");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kBlock && packed.size(1) == x_in.size(1),
              "packed weight does not match x (pack it with pack_linear_weight)");
  TORCH_CHECK(packed.size(0) * kBlock >= n, "more outputs than the packed weight holds");
  const auto x = x_in.contiguous();
  const int64_t rows = x.size(0), k = x.size(1);
  auto y = torch::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (n + kBlock - 1) / kBlock, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t r0 = 0; r0 < rows; r0 += kRowChunk) {
      const int64_t chunk_rows = std::min(kRowChunk, rows - r0);
      const int64_t tiles = (chunk_rows + kMaxRows - 1) / kMaxRows;
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t cols = std::min<int64_t>(kBlock, n - b * kBlock);
        for (int64_t k0 = 0; k0 < k; k0 += kChunk) {
          int64_t r = r0;
          for (int64_t t = 0; t < tiles; ++t) {  // tiles of near-equal height
            const int64_t height = (r0 + chunk_rows - r) / (tiles - t);
            const Tile tile{xp + r * k, k, wp + b * k * kBlock, bp ? bp + b * kBlock : nullptr,
                            k0, std::min(k, k0 + kChunk), yp + r * n + b * kBlock, n, cols};
            kMicro[height - 1](tile);
            r += height;
          }
        }
      }
    }
  });
  return y;
}
