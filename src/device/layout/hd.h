// Marks functions that host planning code and kernels both call.
#pragma once

#if defined(__CUDACC__)
#define EPMOE_HD __host__ __device__ __forceinline__
#else
#define EPMOE_HD inline
#endif

namespace epmoe::layout {

template <class T>
EPMOE_HD constexpr T ceil_div(T a, T b) { return (a + b - 1) / b; }
template <class T>
EPMOE_HD constexpr T round_up(T a, T b) { return ceil_div(a, b) * b; }

}  // namespace epmoe::layout
