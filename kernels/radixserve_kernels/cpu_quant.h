// float8_e4m3fn bits -> float, shared by the FP8 weight GEMM and the FP8 KV cache's attention.
#pragma once
#include <cstdint>
#include <cstring>

namespace cpu_quant {

// Exact for every finite e4m3fn value (written with selects, not branches, so that loops over
// it vectorize): a normal number's exponent and mantissa move into float32's fields (bias 7 ->
// 127); a subnormal is mantissa x 2^-9. The NaN codes (0x7f, 0xff) read as +-480.
inline float fp8_value(uint8_t b) {
  const uint32_t e = (b >> 3) & 0xF, m = b & 7;
  const uint32_t bits = ((e + 120) << 23) | (m << 20);
  float normal;
  std::memcpy(&normal, &bits, sizeof(normal));
  const float v = e != 0 ? normal : static_cast<float>(m) * 0.001953125f;
  return (b & 0x80) != 0 ? -v : v;
}

}  // namespace cpu_quant
