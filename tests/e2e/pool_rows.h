// The expert-pool rows of sampled tokens, read from every rank's pool after a forward call and
// gathered to the rank that owns each token (the FP8 kernel-consistent check).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "epmoe/comm.h"
#include "epmoe/layer.h"
#include "epmoe/status.h"
#include "reference/data.h"

namespace epmoe::e2e {

// One (token, slot) row as the layer left it in the pool of the rank that owns its expert.
struct PoolRow {
  int src_rank = 0, token = 0, slot = 0;
  int owner = 0, local_expert = 0;  // the rank whose pool held it, and the expert's segment there
  std::vector<uint8_t> a_q;         // [I] e4m3 codes of step 5 (a_pool)
  std::vector<float> a_s;           // [I/128] their scales (a_scale)
  std::vector<uint16_t> o;          // [H] bf16 step-6 output (o_pool)
};

// Collective over `comm` (every rank calls it after the same forward call; FP8 layers only).
// Synchronizes `stream`, reads this rank's pool through the layer's internal hooks, keeps the valid
// rows whose (source rank, token) is in sample[source rank], gathers them from every rank with one
// ncclAllGather, and returns in *mine the rows whose source is this rank, sorted by (token, slot).
// Checks on the way, reported in *defect (and still gathering, so no peer is left waiting): every
// row inside an expert's count has a decodable row_source that names a slot routed to that expert.
Status gather_sampled_rows(MoELayer& layer, Communicator& comm, const ref::Problem& p,
                           const std::vector<ref::RankInput>& inputs, const std::vector<std::vector<int>>& sample,
                           cudaStream_t stream, std::vector<PoolRow>* mine, std::string* defect);

}  // namespace epmoe::e2e
