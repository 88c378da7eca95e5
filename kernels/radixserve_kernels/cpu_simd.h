// Eight-float vectors shared by the CPU kernels (GCC vector extensions; AVX2 where built for it).
#pragma once
#include <cstdint>
#include <cstring>
#if defined(__AVX__)
#include <immintrin.h>
#endif

typedef float Vec8 __attribute__((vector_size(8 * sizeof(float))));
typedef int32_t Int8 __attribute__((vector_size(8 * sizeof(int32_t))));

// The locality a software prefetch of streamed data (weights, K/V rows) passes to
// __builtin_prefetch: 2 (prefetcht1, into L2) on AVX-512 machines, where it leaves L1's miss
// buffers to the loads, and 3 (prefetcht0, every level) elsewhere (bench/results/cpu.md).
#if defined(__AVX512F__)
constexpr int kPrefetchLocality = 2;
#else
constexpr int kPrefetchLocality = 3;
#endif

inline Vec8 load8(const float* p) { Vec8 v; std::memcpy(&v, p, sizeof(Vec8)); return v; }
inline void store8(float* p, Vec8 v) { std::memcpy(p, &v, sizeof(Vec8)); }

#if defined(__AVX__)
// e^x for x already clamped to [-87, 88] (2^n stays a normal float), n = round(x / ln 2), lane by
// lane in vectors V of floats (I: as many int32): 2^n * e^r with e^r from Cephes' degree-6
// polynomial; relative error ~1e-7.
template <typename V, typename I>
inline V exp_clamped(V x, V n) {
  const V r = x - n * 0.693359375f + n * 2.12194440e-4f;  // x - n ln 2, ln 2 split in two parts
  V p = 1.9875691500e-4f * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const I bits = (__builtin_convertvector(n, I) + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// e^x, eight at a time. glibc's expf stayed scalar in the extend kernel (half its time) and took
// its 4-wide SSE form in SwiGLU.
inline Vec8 exp8(Vec8 x) {
  x = x < -87.f ? Vec8{} - 87.f : x;
  x = x > 88.f ? Vec8{} + 88.f : x;
  const Vec8 n = Vec8(_mm256_round_ps(__m256(x * 1.44269504f), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  return exp_clamped<Vec8, Int8>(x, n);
}
#endif

#if defined(__AVX512F__)
typedef float Vec16 __attribute__((vector_size(16 * sizeof(float))));
typedef int32_t Int16 __attribute__((vector_size(16 * sizeof(int32_t))));

// e^x, sixteen at a time (as exp8).
inline Vec16 exp16(Vec16 x) {
  x = x < -87.f ? Vec16{} - 87.f : x;
  x = x > 88.f ? Vec16{} + 88.f : x;
  const Vec16 n =
      Vec16(_mm512_roundscale_ps(__m512(x * 1.44269504f), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  return exp_clamped<Vec16, Int16>(x, n);
}
#endif
