// The dispatch quantizer's division (quant::GroupDivisor, src/device/quant/fp8_quant.cuh) against
// __fdiv_rn, which SPEC step 1 names: every finite bf16 value x against a sweep of scales s, with
// |x| <= 448 s as the scale rule guarantees. Where the fast path is taken and |x| >= 2^-100 the
// fp32 quotients must be equal bit for bit; below 2^-100 the e4m3 codes must be. Then the
// eight-channel quantizer with non-finite lanes and extreme scales, which take __fdiv_rn itself.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "device/quant/fp8_quant.cuh"
#include "gpu/gpu_test_util.h"

namespace {

using epmoe::quant::GroupDivisor;

struct DivideCounts {
  unsigned long long checked;   // (x, s) pairs on the fast path
  unsigned long long fallback;  // pairs whose s is outside the fast range
  unsigned long long wrong;     // mismatches
  unsigned int first_x;         // the first mismatch (bf16 bits, scale index)
  unsigned int first_s;
};

__global__ void divide_sweep_kernel(const float* scales, int num_scales, DivideCounts* out) {
  unsigned long long checked = 0, fallback = 0;
  const int64_t total = int64_t(num_scales) << 16;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const uint32_t bits = uint32_t(i & 0xFFFF);
    const int si = int(i >> 16);
    const float x = __uint_as_float(bits << 16);
    const float s = scales[si];
    if (!isfinite(x) || fabsf(x) > 448.0f * s * (1.0f + 0x1p-20f)) continue;
    const GroupDivisor d = GroupDivisor::of(s);
    if (!d.fast) {
      ++fallback;
      continue;
    }
    ++checked;
    const float q = d.divide(x);
    const float ref = __fdiv_rn(x, s);
    bool ok;
    if (fabsf(x) >= 0x1p-100f) {
      ok = __float_as_uint(q) == __float_as_uint(ref);
    } else {
      ok = epmoe::quant::encode_e4m3x2(q, q) == epmoe::quant::encode_e4m3x2(ref, ref);
    }
    if (!ok && atomicAdd(&out->wrong, 1ull) == 0) {
      out->first_x = bits;
      out->first_s = uint32_t(si);
    }
  }
  atomicAdd(&out->checked, checked);
  atomicAdd(&out->fallback, fallback);
}

// One 16-byte vector per thread through quantize8_e4m3 and quantize8_e4m3_ieee.
__global__ void quantize8_kernel(const uint4* v, const float* s, int n, uint2* fast, uint2* ieee) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  fast[i] = epmoe::quant::quantize8_e4m3(v[i], s[i]);
  ieee[i] = epmoe::quant::quantize8_e4m3_ieee(v[i], s[i]);
}

float host_scale(float amax) {  // SPEC step 1's rule (no pow2), in float as on the device
  return std::max(amax, 1e-4f) / 448.0f;
}

TEST(Fp8Divide, FastPathMatchesIeeeDivisionForEveryBf16Value) {
  EPMOE_REQUIRE_GPUS(1);
  std::mt19937 rng(std::random_device{}());
  std::vector<float> scales;
  // Scales the rule produces: from amax values spread over the bf16 range, and their pow2 form.
  std::uniform_real_distribution<float> expo(-40.0f, 40.0f), mant(1.0f, 2.0f);
  for (int i = 0; i < 3000; ++i) {
    const float s = host_scale(std::ldexp(mant(rng), int(expo(rng))));
    scales.push_back(s);
    int e;
    const float m = std::frexp(s, &e);
    scales.push_back(m == 0.5f ? s : std::ldexp(1.0f, e));
  }
  // Any float in and just past the fast range, with random mantissas.
  std::uniform_int_distribution<uint32_t> any_mant(0, 0x7FFFFF);
  for (int e = -70; e <= 24; ++e)
    for (int j = 0; j < 20; ++j) {
      uint32_t b;
      const float base = std::ldexp(1.0f, e);
      std::memcpy(&b, &base, 4);
      b |= any_mant(rng);
      float f;
      std::memcpy(&f, &b, 4);
      scales.push_back(f);
    }
  for (float f : {0x1p-64f, 0x1p20f, std::nextafter(0x1p-64f, 1.0f), std::nextafter(0x1p20f, 0.0f), 1e-4f / 448.0f})
    scales.push_back(f);

  float* d_scales = nullptr;
  DivideCounts* d_out = nullptr;
  EPMOE_CUDA_OK(cudaMalloc(&d_scales, scales.size() * sizeof(float)));
  EPMOE_CUDA_OK(cudaMalloc(&d_out, sizeof(DivideCounts)));
  EPMOE_CUDA_OK(cudaMemcpy(d_scales, scales.data(), scales.size() * sizeof(float), cudaMemcpyHostToDevice));
  EPMOE_CUDA_OK(cudaMemset(d_out, 0, sizeof(DivideCounts)));
  divide_sweep_kernel<<<1024, 256>>>(d_scales, int(scales.size()), d_out);
  EPMOE_CUDA_OK(cudaGetLastError());
  DivideCounts c{};
  EPMOE_CUDA_OK(cudaMemcpy(&c, d_out, sizeof(c), cudaMemcpyDeviceToHost));
  cudaFree(d_scales);
  cudaFree(d_out);
  // Some pairs must have been checked on the fast path and some scales must lie outside it, or the
  // sweep tests nothing.
  EXPECT_GT(c.checked, 100000000ull);
  EXPECT_GT(c.fallback, 0ull);
  EXPECT_EQ(c.wrong, 0ull) << "first mismatch: x bits 0x" << std::hex << c.first_x << " scale "
                           << std::hexfloat << (c.wrong ? scales[c.first_s] : 0.0f);
}

TEST(Fp8Divide, QuantizerMatchesIeeeWithSpecialValuesAndScales) {
  EPMOE_REQUIRE_GPUS(1);
  std::mt19937 rng(std::random_device{}());
  const int n = 1 << 16;
  std::vector<uint4> v(n);
  std::vector<float> s(n);
  std::uniform_int_distribution<uint32_t> word;
  std::uniform_int_distribution<int> pick(0, 15);
  const uint16_t specials[] = {0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x0000, 0x8000, 0x0001, 0x8001, 0x7F7F, 0xFF7F};
  for (int i = 0; i < n; ++i) {
    uint16_t h[8];
    float amax = 0.0f;
    for (int j = 0; j < 8; ++j) {
      h[j] = uint16_t(word(rng));
      if (pick(rng) == 0) h[j] = specials[word(rng) % 10];
      uint32_t b = uint32_t(h[j]) << 16;
      float f;
      std::memcpy(&f, &b, 4);
      if (std::isfinite(f)) amax = std::max(amax, std::fabs(f));
    }
    std::memcpy(&v[i], h, 16);
    // The rule's scale for this lane's finite values, or now and then one outside the fast range
    // (the rule gives inf when a lane holds an inf; the vector check must catch that case here).
    const int far = int(word(rng) % 170);
    s[i] = pick(rng) != 0 ? host_scale(amax)
           : far == 0     ? INFINITY
                          : std::ldexp(1.0f, far < 85 ? 20 + far : -64 - (far - 84));
  }
  uint4* d_v = nullptr;
  float* d_s = nullptr;
  uint2 *d_fast = nullptr, *d_ieee = nullptr;
  EPMOE_CUDA_OK(cudaMalloc(&d_v, n * sizeof(uint4)));
  EPMOE_CUDA_OK(cudaMalloc(&d_s, n * sizeof(float)));
  EPMOE_CUDA_OK(cudaMalloc(&d_fast, n * sizeof(uint2)));
  EPMOE_CUDA_OK(cudaMalloc(&d_ieee, n * sizeof(uint2)));
  EPMOE_CUDA_OK(cudaMemcpy(d_v, v.data(), n * sizeof(uint4), cudaMemcpyHostToDevice));
  EPMOE_CUDA_OK(cudaMemcpy(d_s, s.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  EPMOE_CUDA_OK(cudaMemset(d_fast, 0xA5, n * sizeof(uint2)));  // poison
  EPMOE_CUDA_OK(cudaMemset(d_ieee, 0x5A, n * sizeof(uint2)));
  quantize8_kernel<<<(n + 255) / 256, 256>>>(d_v, d_s, n, d_fast, d_ieee);
  EPMOE_CUDA_OK(cudaGetLastError());
  std::vector<uint2> fast(n), ieee(n);
  EPMOE_CUDA_OK(cudaMemcpy(fast.data(), d_fast, n * sizeof(uint2), cudaMemcpyDeviceToHost));
  EPMOE_CUDA_OK(cudaMemcpy(ieee.data(), d_ieee, n * sizeof(uint2), cudaMemcpyDeviceToHost));
  cudaFree(d_v);
  cudaFree(d_s);
  cudaFree(d_fast);
  cudaFree(d_ieee);
  int wrong = 0, first = -1;
  for (int i = 0; i < n; ++i)
    if (fast[i].x != ieee[i].x || fast[i].y != ieee[i].y) {
      if (first < 0) first = i;
      ++wrong;
    }
  EXPECT_EQ(wrong, 0) << "first mismatch at vector " << first << " scale " << std::hexfloat << (first >= 0 ? s[first] : 0.0f);
}

}  // namespace
