// L1 epilogue: gate/up -> clamp -> silu(gate) * up * routing weight -> FP8 1x128 requant (or bf16).
//
// The block's B rows are [gate block j | up block j] (see docs/GEMM.md, the W1 interleave), so
// every thread holds gate (acc[0..63]) and the matching up values (acc[64..127]) of the same
// channels; a quad of lanes holds one row's whole 128-channel group, which is quantized with a
// single scale (the scale bit-for-bit the rule of SPEC step 5, the codes as a * (1 / s)).
#pragma once

#include <cstdint>

#include "device/gemm/sm90_gemm_params.h"
#include "device/debug/diag_trace.cuh"
#include "device/pipeline/sm90_watchdog.cuh"
#include "device/ptx/fence.cuh"
#include "device/ptx/ld_st.cuh"
#include "device/ptx/math.cuh"
#include "device/quant/fp8_quant.cuh"
#include "device/quant/fp8_scale.cuh"
#include "device/scheduler/sm90_grouped_scheduler.cuh"

namespace epmoe::gemm {

// silu(g) = g / (1 + e^-g) from two MUFU instructions: e^-g = 2^(-g log2 e) (ex2.approx, relative
// error ~2^-22) and an approximate reciprocal (~1 ulp). Why not the accurate expf and an IEEE
// division (the first version): they were about 40 instructions per channel, three MUFU and a
// slow-path call each, and the epilogue runs while the tensor cores wait; the approximations move
// a value by a few fp32 ulps, 2^-20 of an e4m3 rounding step, so an FP8 code changes only for
// values within that distance of a rounding boundary (SPEC's bound is 1e-2 relative on y).
// The .ftz forms are exact here: ex2's result is >= 2^-126 for any g that matters (for
// g > 87, e^-g flushes to 0 and silu = g, as it should), and rcp's argument is >= 1.
__device__ __forceinline__ float silu_f32(float g) {
  const float e = ptx::ex2_approx_ftz_f32(g * -1.4426950408889634f);
  return g * ptx::rcp_approx_ftz_f32(1.0f + e);
}

// The amax exchange of the megakernel's split L1 units (FP8 decode variant): per pair of halves
// (an L1 tile) and math warpgroup, one arrival counter (0 between calls: the kernel zeroes the
// ones a call used after its grid barrier) and each half's 64 partial row maxima.
struct SplitExchange {
  uint32_t* ctr;  // [pair x 2 + warpgroup]
  float* amax;    // [(pair x 2 + warpgroup) x 2 + half][64 rows]
};

// kToSmem (FP8 only, the deferred L1 store of sm90_epilogue_deferred.cuh): the codes go to this
// warpgroup's staging tile (`slab_s`: 64 rows x 128 bytes, 16-byte chunk c of row r at
// (c ^ (r % 8)) * 16, the layout of a 128-byte swizzled TMA box) and the row scales to
// `scale_s` (128 floats, the tile's rows), instead of global memory; every row is written (the
// caller sends only full tiles).
template <bool kFp8, bool kToSmem = false>
struct Sm90EpilogueSwiGLU {
  static_assert(kFp8 || !kToSmem, "the staging-tile store is FP8 only (BF16 L1 tiles: values + the kept stage)");
  // This thread's first row in the tile (its second is r0 + 8).
  __device__ static int first_row(int wg) {
    return wg * kWarpgroupM + ((threadIdx.x / 32) % 4) * 16 + (threadIdx.x % 32) / 4;
  }

  // The activations a = silu(clamped gate) * clamped up * routing weight of this thread's 64
  // channels, in the layout of one n128 accumulator half (a[i] pairs acc[i] with acc[64 + i]).
  __device__ static void values(const float (&acc)[128], const GroupedGemmParams& p, const scheduler::GemmTile& t,
                                int r0, float (&a)[64]) {
    const bool valid0 = r0 < t.rows_valid;
    const bool valid1 = r0 + 8 < t.rows_valid;
    // Padding rows may hold NaN weights; they are never stored, so any value does.
    const float w0 = valid0 ? ptx::ld_cg_f32(p.row_weight + t.row0 + r0) : 0.0f;
    const float w1 = valid1 ? ptx::ld_cg_f32(p.row_weight + t.row0 + r0 + 8) : 0.0f;
    const float c = p.clamp;
#pragma unroll
    for (int i = 0; i < 64; ++i) {
      float g = acc[i];
      float u = acc[64 + i];
      if (c > 0.0f) {
        u = fminf(fmaxf(u, -c), c);
        g = fminf(g, c);
      }
      a[i] = silu_f32(g) * u * ((i & 2) ? w1 : w0);
    }
  }

  // trace_slot: the trace build's tile slot (diag::tile_trace field 4: the values computed).
  // dry (the megakernel's idle warpgroup, none of whose rows is valid): every instruction of the
  // global-store path runs, and no store is made (sm90_math_tiles, kIdleWarm).
  __device__ static void run(const float (&acc)[128], const GroupedGemmParams& p, const scheduler::GemmTile& t,
                             int wg, uint32_t slab_s = 0, uint32_t scale_s = 0, int trace_slot = -1,
                             bool dry = false) {
    const int warp = (threadIdx.x / 32) % 4;
    const int lane = threadIdx.x % 32;
    const int r0 = first_row(wg);
    float a[64];
    values(acc, p, t, r0, a);
    if (trace_slot >= 0) diag::tile_trace(0, trace_slot, 4);

    const int64_t out_col = int64_t(t.n_block) * kHalfN + 2 * (lane % 4);
    if constexpr (kFp8) {
      float amax0 = 0.0f, amax1 = 0.0f;
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        amax0 = fmaxf(amax0, fmaxf(fabsf(a[4 * i + 0]), fabsf(a[4 * i + 1])));
        amax1 = fmaxf(amax1, fmaxf(fabsf(a[4 * i + 2]), fabsf(a[4 * i + 3])));
      }
      // The four lanes of a quad hold the 128 channels of the same two rows.
#pragma unroll
      for (int m = 1; m <= 2; m <<= 1) {
        amax0 = fmaxf(amax0, __shfl_xor_sync(0xFFFFFFFFu, amax0, m));
        amax1 = fmaxf(amax1, __shfl_xor_sync(0xFFFFFFFFu, amax1, m));
      }
      const bool pow2 = p.pow2_scales != 0;
      const float s[2] = {quant::scale_1x128(amax0, pow2), quant::scale_1x128(amax1, pow2)};
      // The codes are a * (1 / s) (see quant::reciprocal_scale).
      const float inv[2] = {quant::reciprocal_scale(s[0]), quant::reciprocal_scale(s[1])};
      if constexpr (kToSmem) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const uint32_t r = uint32_t(warp * 16 + lane / 4 + half * 8);  // row of the staging tile
          // Channels 8 i + 2 q, + 1 are bytes 8 i + 2 q, + 1 of the row: chunk i / 2.
#pragma unroll
          for (int i = 0; i < 16; ++i)
            ptx::st_shared_u16(slab_s + r * 128u + ((uint32_t(i / 2) ^ (r & 7u)) * 16u) +
                                   uint32_t(8 * (i % 2) + 2 * (lane % 4)),
                               quant::encode_e4m3x2_times(a[4 * i + 2 * half], a[4 * i + 2 * half + 1], inv[half]));
          if (lane % 4 == 0) ptx::st_shared_f32(scale_s + uint32_t(wg * kWarpgroupM + int(r)) * 4u, s[half]);
        }
        return;
      }
      uint8_t* out = static_cast<uint8_t*>(p.out);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = r0 + half * 8;
        // dry: no row is valid, so the loop runs (for its instructions) and stores nothing.
        if (r >= t.rows_valid && !dry) continue;
        uint8_t* row = out + int64_t(t.row0 + r) * p.out_ld + out_col;
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          const uint16_t codes = quant::encode_e4m3x2_times(a[4 * i + 2 * half], a[4 * i + 2 * half + 1], inv[half]);
          if (!dry) *reinterpret_cast<uint16_t*>(row + 8 * i) = codes;
        }
        if (!dry && lane % 4 == 0) p.out_scale[int64_t(t.n_block) * p.scale_stride + t.row0 + r] = s[half];
      }
    } else {
      uint16_t* out = static_cast<uint16_t*>(p.out);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = r0 + half * 8;
        if (r >= t.rows_valid) continue;
        uint16_t* row = out + int64_t(t.row0 + r) * p.out_ld + out_col;
#pragma unroll
        for (int i = 0; i < 16; ++i)
          *reinterpret_cast<uint32_t*>(row + 8 * i) =
              ptx::cvt_rn_bf16x2(a[4 * i + 2 * half], a[4 * i + 2 * half + 1]);
      }
    }
  }

  // A split unit (FP8 only): half h = unit % 2 of L1 tile n_block / 2 (the scheduler's n_block
  // counts halves), its 64 channels 64 h.. in acc[0..31] (gate) and acc[64..95] (up)
  // (Sm90Fp8Mainloop::block_math_split). The row's 1x128 scale needs the amax over both halves, which
  // run on two blocks: each half writes its 64 partial row maxima, adds 1 to the pair's counter
  // (release) and waits (bounded) until the counter reads 2, then takes the larger of the two and
  // stores its own 64 channels' codes; half 0 also stores the row scales. The maximum is exact, so
  // the scale and the codes are bit for bit those of the whole tile (run).
  // Deadlock-free because split L1 units are taken in the static order (block b: units b, b + grid,
  // ...; no claims) on a grid of at least 2: a pair's halves are then on two blocks, every block
  // takes its units in increasing order, and the lowest unit not yet at its exchange always can get
  // there (its block's earlier units, and its partner if lower, are all past theirs).
  // dry: the warm pass (sm90_math_tiles, kIdleWarm): the same instructions, no store, no exchange.
  // barrier_id: the warpgroup's named barrier (128 threads); trace_slot as in run. Returns false if
  // the wait expired; *seen is then the counter's value and *slot its index.
  __device__ static bool run_split(const float (&acc)[128], const GroupedGemmParams& p, const scheduler::GemmTile& t,
                                   int wg, int unit, const SplitExchange& x, uint32_t barrier_id, bool dry,
                                   uint32_t* seen, int* slot, int trace_slot = -1) {
    static_assert(kFp8 && !kToSmem, "split units are the FP8 decode variant's");
    const int warp = (threadIdx.x / 32) % 4;
    const int lane = threadIdx.x % 32;
    const int r0 = first_row(wg);
    const bool valid0 = r0 < t.rows_valid;
    const bool valid1 = r0 + 8 < t.rows_valid;
    const float w0 = valid0 ? ptx::ld_cg_f32(p.row_weight + t.row0 + r0) : 0.0f;
    const float w1 = valid1 ? ptx::ld_cg_f32(p.row_weight + t.row0 + r0 + 8) : 0.0f;
    const float c = p.clamp;
    float a[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      float g = acc[i];
      float u = acc[64 + i];
      if (c > 0.0f) {
        u = fminf(fmaxf(u, -c), c);
        g = fminf(g, c);
      }
      a[i] = silu_f32(g) * u * ((i & 2) ? w1 : w0);
    }
    if (trace_slot >= 0) diag::tile_trace(0, trace_slot, 4);
    float amax0 = 0.0f, amax1 = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      amax0 = fmaxf(amax0, fmaxf(fabsf(a[4 * i + 0]), fabsf(a[4 * i + 1])));
      amax1 = fmaxf(amax1, fmaxf(fabsf(a[4 * i + 2]), fabsf(a[4 * i + 3])));
    }
#pragma unroll
    for (int m = 1; m <= 2; m <<= 1) {
      amax0 = fmaxf(amax0, __shfl_xor_sync(0xFFFFFFFFu, amax0, m));
      amax1 = fmaxf(amax1, __shfl_xor_sync(0xFFFFFFFFu, amax1, m));
    }
    const int h = unit & 1;
    const int s = (unit >> 1) * 2 + wg;
    const int rr = warp * 16 + lane / 4;  // this thread's first row among the warpgroup's 64
    float* mine = x.amax + (int64_t(s) * 2 + h) * kWarpgroupM;
    const float* theirs = x.amax + (int64_t(s) * 2 + (h ^ 1)) * kWarpgroupM;
    if (!dry && lane % 4 == 0) {
      mine[rr] = amax0;
      mine[rr + 8] = amax1;
    }
    // The warpgroup's maxima are written: one release for all of them (cumulative over the
    // barrier), then the wait for the other half.
    ptx::named_barrier_sync(barrier_id, 128);
    uint32_t failed = 0;
    if (!dry && threadIdx.x % 128 == 0) {
      ptx::red_add_release_gpu(x.ctr + s, 1u);
      uint32_t v = ptx::ld_acquire_gpu(x.ctr + s);
      if (v < 2u) {
        const uint64_t start = ptx::globaltimer_ns();
        const uint64_t limit = pipeline::watchdog_timeout_ns();
        while ((v = ptx::ld_acquire_gpu(x.ctr + s)) < 2u) {
          if (ptx::globaltimer_ns() - start > limit) {
            failed = 1;
            break;
          }
          ptx::nanosleep(32);
        }
      }
    }
    if (ptx::named_barrier_sync_or(barrier_id, 128, failed)) {
      *seen = ptx::ld_acquire_gpu(x.ctr + s);
      *slot = s;
      return false;
    }
    if (!dry) {
      amax0 = fmaxf(amax0, ptx::ld_cg_f32(theirs + rr));
      amax1 = fmaxf(amax1, ptx::ld_cg_f32(theirs + rr + 8));
    }
    const bool pow2 = p.pow2_scales != 0;
    const float sc[2] = {quant::scale_1x128(amax0, pow2), quant::scale_1x128(amax1, pow2)};
    const float inv[2] = {quant::reciprocal_scale(sc[0]), quant::reciprocal_scale(sc[1])};
    const int n_block = t.n_block >> 1;
    const int64_t out_col = int64_t(n_block) * kHalfN + h * (kHalfN / 2) + 2 * (lane % 4);
    uint8_t* out = static_cast<uint8_t*>(p.out);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = r0 + half * 8;
      if (r >= t.rows_valid && !dry) continue;
      uint8_t* row = out + int64_t(t.row0 + r) * p.out_ld + out_col;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const uint16_t codes = quant::encode_e4m3x2_times(a[4 * i + 2 * half], a[4 * i + 2 * half + 1], inv[half]);
        if (!dry) *reinterpret_cast<uint16_t*>(row + 8 * i) = codes;
      }
      if (!dry && h == 0 && lane % 4 == 0) p.out_scale[int64_t(n_block) * p.scale_stride + t.row0 + r] = sc[half];
    }
    return true;
  }
};

}  // namespace epmoe::gemm
