// What a bounded wait does when it expires: record who waited on what, then trap.
//
// Why no printf by default: any function call (printf is one) in a kernel that issues wgmma
// makes ptxas serialize the whole wgmma pipeline (warning C7510), at any position in the kernel.
// So the record goes to a device global that a debugger or a post-mortem core dump shows, and
// the trap ends the grid with an error the host sees at its next synchronisation. Build with
// -DEPMOE_GEMM_TIMEOUT_PRINTF to also print it (slower kernels, for debugging hangs).
#pragma once

#include <cstdint>
#include <cstdio>

#include "device/pipeline/sm90_tma_pipeline.cuh"
#include "device/ptx/fence.cuh"

namespace epmoe::pipeline {

// kProducerReady: the fused kernel's producer waiting for an L1 m-block that L2 reads.
// kEpilogueDrained: a math warpgroup waiting for the deferred epilogue's storer to drain the
// previous tile; kStorerStaged: a storer waiting for a tile's output (sm90_epilogue_deferred.cuh).
enum class WaitSite : uint32_t {
  kNone = 0,
  kProducerEmpty = 1,
  kConsumerFull = 2,
  kProducerReady = 3,
  kEpilogueDrained = 4,
  kStorerStaged = 5
};

struct TimeoutRecord {
  uint32_t site;  // WaitSite
  uint32_t block;
  uint32_t thread;
  uint32_t stage;
  uint32_t parity;
  uint32_t tile;  // linear tile index the role was working on
};

// One copy per translation unit (whole-program compilation): each kernel module has its own.
static __device__ TimeoutRecord g_gemm_timeout;

__device__ __forceinline__ void report_timeout(WaitSite site, uint32_t stage, uint32_t parity, int tile) {
  volatile TimeoutRecord* r = &g_gemm_timeout;
  r->block = blockIdx.x;
  r->thread = threadIdx.x;
  r->stage = stage;
  r->parity = parity;
  r->tile = uint32_t(tile);
  r->site = uint32_t(site);
  __threadfence_system();
#ifdef EPMOE_GEMM_TIMEOUT_PRINTF
  printf("epmoe gemm: timeout: block %d thread %d waited > %llu ns on the %s barrier of stage %u (parity %u), "
         "linear tile %d\n",
         blockIdx.x, threadIdx.x, (unsigned long long)kWaitTimeoutNs,
         site == WaitSite::kProducerEmpty   ? "empty"
         : site == WaitSite::kConsumerFull  ? "full"
         : site == WaitSite::kProducerReady ? "m-block ready"
         : site == WaitSite::kEpilogueDrained ? "epilogue drained"
                                              : "epilogue staged", stage, parity, tile);
#endif
  ptx::trap();
}

}  // namespace epmoe::pipeline
