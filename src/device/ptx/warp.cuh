// Warp-level PTX: electing one lane.
#pragma once

#include <cstdint>

namespace epmoe::ptx {

// True in exactly one lane of the full warp (elect.sync; every lane must call it). Why instead of
// `lane == 0`: the lane index is a special-register read (S2R, tens of cycles), which ptxas
// re-reads inside a K loop at its register cap; the election is one instruction with no source.
__device__ __forceinline__ bool elect_one_sync() {
  uint32_t is_elected;
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "elect.sync _|p, 0xffffffff;\n"
      "selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(is_elected));
  return is_elected != 0;
}

}  // namespace epmoe::ptx
