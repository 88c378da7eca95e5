// AMX tiles (Intel AMX-BF16), shared by the bf16 GEMM (cpu_linear.cpp) and the bf16 extend
// attention (cpu_attention.cpp). RADIXSERVE_AMX is 1 when the build targets a CPU with AMX-BF16;
// amx_ready() then also says whether the kernel lets this process use the tiles.
#pragma once
#include <cstdint>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define RADIXSERVE_AMX 1

namespace cpu_amx {

constexpr int kRows = 16;   // rows of a tile
constexpr int kPairs = 16;  // bf16 pairs in a row of an A tile (64 bytes), rows of a B tile

// Linux hands out the tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
// XTILEDATA), for the whole process; asked once.
inline bool amx_ready() {
  static const bool ready = [] {
    constexpr int kReqXcompPerm = 0x1023, kXfeatureTileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureTileData) == 0;
  }();
  return ready;
}

// Loads this thread's tile configuration: tile t has rows[t] rows of 64 bytes (0: unused).
inline void configure_tiles(const int (&rows)[8]) {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = rows[t] ? 64 : 0, cfg.rows[t] = static_cast<uint8_t>(rows[t]);
  _tile_loadconfig(&cfg);
}

}  // namespace cpu_amx
#else
#define RADIXSERVE_AMX 0
#endif
