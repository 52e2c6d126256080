// Host side of device/debug/diag_trace.cuh: each kernel translation unit of a trace build
// (-DEPMOE_DIAG_TRACE=ON) defines one of these, which copies its trace buffer and prints, per
// trace point, how many blocks reached it and the min / median / max time after the earliest
// block's first point, in us. Declared always, defined only in trace builds.
#pragma once

#include <cstdio>

namespace epmoe::diag {

void dump_dispatch_trace(std::FILE* out);  // the standalone dispatch kernel
void dump_combine_trace(std::FILE* out);   // the standalone combine kernel
void dump_fused_trace(std::FILE* out);     // the FP8 megakernel
// Per-tile timelines (diag::g_tiles): the standalone FP8 GEMM kernels' last L1 and L2 calls, and
// the FP8 megakernel's last call.
void dump_gemm_tiles(std::FILE* out);
void dump_fused_tiles(std::FILE* out);

}  // namespace epmoe::diag
