// Shared helpers for single-process GPU tests.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdio>

namespace epmoe::test {

// Number of visible GPUs; 0 when the driver or the device is missing.
inline int visible_gpus() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

}  // namespace epmoe::test

// Skip (not fail) a test on a machine without enough GPUs, e.g. CI.
#define EPMOE_REQUIRE_GPUS(n)                                                          \
  do {                                                                                 \
    int _have = ::epmoe::test::visible_gpus();                                         \
    if (_have < (n)) GTEST_SKIP() << "needs " << (n) << " GPU(s), " << _have << " visible"; \
  } while (0)

#define EPMOE_CUDA_OK(call)                                                               \
  do {                                                                                    \
    cudaError_t _e = (call);                                                              \
    ASSERT_EQ(_e, cudaSuccess) << #call << ": " << cudaGetErrorName(_e) << " "            \
                               << cudaGetErrorString(_e);                                 \
  } while (0)

// Checks a Status-returning epmoe call.
#define EPMOE_OK(call)                                                \
  do {                                                                \
    ::epmoe::Status _s = (call);                                      \
    ASSERT_TRUE(_s.ok()) << #call << " -> " << _s.to_string();        \
  } while (0)
