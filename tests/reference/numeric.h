// Scalar number formats and the quantization rules of SPEC.md, on the host.
//
// Everything here is bit-exact by design: GPU kernels are tested against these
// functions code for code, so they must not depend on compiler flags. Build
// without -ffast-math (in particular without -freciprocal-math): the
// quantizers below rely on a true IEEE fp32 division.
#pragma once

#include <cstdint>

namespace epmoe::ref {

// ---- bf16 -----------------------------------------------------------------

// Round to nearest, ties to even. NaN becomes the canonical bf16 NaN 0x7FFF,
// which is what cvt.rn.bf16.f32 produces; a finite value that rounds past the
// largest bf16 becomes infinity, as IEEE RNE does.
uint16_t bf16_from_float(float x);
float bf16_to_float(uint16_t b);

// ---- FP8 E4M3 (OCP) -------------------------------------------------------
// Bias 7, no infinities, 0x7F / 0xFF are NaN, largest finite 448 (0x7E),
// smallest subnormal 2^-9.

inline constexpr float kE4M3Max = 448.0f;
inline constexpr uint8_t kE4M3NaN = 0x7F;

// Matches cvt.rn.satfinite.e4m3x2.f32 / __nv_cvt_float_to_fp8(x, __NV_SATFINITE,
// __NV_E4M3): one rounding straight from fp32, ties to even, any finite or
// infinite magnitude beyond 448 clamps to +-448, NaN -> 0x7F, the sign of zero
// is kept.
uint8_t e4m3_from_float(float x);
float e4m3_to_float(uint8_t q);

// e4m3_to_float of all 256 codes, as double, for inner loops.
const double* e4m3_table();

// ---- Quantization rules (SPEC.md steps 1 and 5) ---------------------------

inline constexpr int kQuantGroup = 128;
inline constexpr float kMinAmax = 1e-4f;

// s = max(amax, 1e-4) / 448 in fp32. With pow2, s is rounded up to the next
// power of two (a power of two stays), exactly, via frexp.
// Why fmax: a NaN amax is ignored like fmaxf does in a GPU amax reduction; a
// NaN input still shows up because its own code is NaN.
float quant_scale(float amax, bool pow2);

// One scale per run of 128 consecutive values: q[i] = e4m3(x[i] / s[i/128]).
// n must be a multiple of 128.
// Why a true division: x * (1/s) differs in the last bit for some x, which can
// move a value across a rounding boundary of e4m3. GPU code must use IEEE
// division (__fdiv_rn, or '/' without fast-math) to stay bit-exact; with pow2
// scales both are exact and agree.
void quantize_1x128(const float* x, int64_t n, bool pow2, uint8_t* q, float* s);

// 128x128 blocks of a row-major [rows][cols] matrix; s is [rows/128][cols/128]
// row-major. rows and cols must be multiples of 128.
void quantize_128x128(const float* w, int rows, int cols, bool pow2, uint8_t* q, float* s);

// ---- Activation -------------------------------------------------------------

// silu(g) = g / (1 + exp(-g)) in fp32 with the libm expf. GPU kernels may use a
// faster exp; the difference is far inside the SPEC tolerance. For g < -88,
// exp overflows to inf and the result is -0, which is the correct limit.
float silu(float g);

}  // namespace epmoe::ref
