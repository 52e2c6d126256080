#include "e2e/pool_rows.h"

#include <nccl.h>

#include <algorithm>
#include <cstring>
#include <sstream>

#include "device/layout/expert_pool.h"
#include "epmoe/dispatch.h"
#include "host/check.h"
#include "host/layer_impl.h"

namespace epmoe::e2e {

namespace {

// A packed row in the gather buffer: 16 bytes of header (source word, local expert, owner), the
// codes, the scales, the o row; padded to 16 bytes.
struct Packing {
  int I, H;
  int64_t codes_at() const { return 16; }
  int64_t scales_at() const { return 16 + ((int64_t(I) + 15) / 16) * 16; }
  int64_t o_at() const { return scales_at() + int64_t(I / 128) * 4; }
  int64_t row_bytes() const { return (o_at() + int64_t(H) * 2 + 15) / 16 * 16; }
};

template <class T>
struct DeviceBytes {
  T* p = nullptr;
  ~DeviceBytes() { if (p) cudaFree(p); }
};

}  // namespace

Status gather_sampled_rows(MoELayer& layer, Communicator& comm, const ref::Problem& p,
                           const std::vector<ref::RankInput>& inputs, const std::vector<std::vector<int>>& sample,
                           cudaStream_t stream, std::vector<PoolRow>* mine, std::string* defect) {
  const int R = comm.size(), rank = comm.rank(), E_loc = p.E_loc();
  mine->clear();
  EPMOE_CUDA_RETURN(cudaStreamSynchronize(stream));
  const ExpertPoolView pool = detail::internals(layer)->dispatcher().pool();
  if (!pool.a_pool || !pool.a_scale || !pool.o_pool || !pool.row_source)
    return Status(StatusCode::kInternal, "gather_sampled_rows: the pool has no a_pool / a_scale / o_pool");

  std::vector<int32_t> count(E_loc), offset(E_loc + 1);
  EPMOE_CUDA_RETURN(cudaMemcpy(count.data(), pool.expert_count, E_loc * 4, cudaMemcpyDeviceToHost));
  EPMOE_CUDA_RETURN(cudaMemcpy(offset.data(), pool.expert_offset, (E_loc + 1) * 4, cudaMemcpyDeviceToHost));
  const int64_t end = offset[E_loc];
  if (end < 0 || end > pool.max_rows) {
    std::ostringstream os;
    os << "rank " << rank << ": expert_offset[E_loc] = " << end << " is outside [0, " << pool.max_rows << "]";
    return Status(StatusCode::kInternal, os.str());
  }
  std::vector<uint32_t> source(size_t(std::max<int64_t>(end, 1)));
  if (end) EPMOE_CUDA_RETURN(cudaMemcpy(source.data(), pool.row_source, end * 4, cudaMemcpyDeviceToHost));

  std::vector<std::vector<char>> sampled(R);
  int64_t sampled_tokens = 0;
  for (int r = 0; r < R; ++r) {
    sampled[r].assign(size_t(inputs[r].T), 0);
    for (int t : sample[r]) sampled[r][t] = 1;
    sampled_tokens += int64_t(sample[r].size());
  }
  // Why this capacity: at most every slot of every sampled token lands on one rank.
  const int64_t capacity = sampled_tokens * p.K;
  const Packing pk{p.I, p.H};
  const int64_t rank_bytes = 16 + capacity * pk.row_bytes();
  std::vector<uint8_t> send(size_t(rank_bytes), 0);
  int64_t n = 0;
  const auto note = [&](const std::string& s) {
    if (defect->empty()) *defect = "rank " + std::to_string(rank) + " pool: " + s;
  };
  using layout::RowSource;
  for (int e = 0; e < E_loc; ++e) {
    if (count[e] < 0 || offset[e] < 0 || offset[e] + count[e] > end) {
      note("expert " + std::to_string(e) + " segment [" + std::to_string(offset[e]) + ", +" +
           std::to_string(count[e]) + ") outside the pool's " + std::to_string(end) + " rows");
      continue;
    }
    for (int64_t row = offset[e]; row < offset[e] + count[e]; ++row) {
      const uint32_t w = source[row];
      const int sr = RowSource::rank(w), t = RowSource::token(w), k = RowSource::slot(w);
      const int global_e = rank * E_loc + e;
      if (w == 0xFFFFFFFFu || sr >= R || t >= inputs[sr].T || k >= p.K ||
          inputs[sr].topk_idx[int64_t(t) * p.K + k] != global_e) {
        std::ostringstream os;
        os << "row " << row << " of expert " << e << " has row_source 0x" << std::hex << w << std::dec
           << " (rank " << sr << ", token " << t << ", slot " << k << "), not a slot routed to expert " << global_e;
        note(os.str());
        continue;
      }
      if (!sampled[sr][t]) continue;
      if (n == capacity) {
        note("more rows of sampled tokens than their slots (" + std::to_string(capacity) + ")");
        break;
      }
      uint8_t* dst = send.data() + 16 + n * pk.row_bytes();
      const uint32_t head[3] = {w, uint32_t(e), uint32_t(rank)};
      std::memcpy(dst, head, sizeof(head));
      EPMOE_CUDA_RETURN(cudaMemcpy(dst + pk.codes_at(), static_cast<const uint8_t*>(pool.a_pool) + row * p.I, p.I,
                                   cudaMemcpyDeviceToHost));
      // MN-major scales: scale[g][row], one float per group, stride scale_stride.
      EPMOE_CUDA_RETURN(cudaMemcpy2D(dst + pk.scales_at(), 4, pool.a_scale + row, size_t(pool.scale_stride) * 4, 4,
                                     size_t(p.I / 128), cudaMemcpyDeviceToHost));
      EPMOE_CUDA_RETURN(cudaMemcpy(dst + pk.o_at(), pool.o_pool + row * p.H, size_t(p.H) * 2, cudaMemcpyDeviceToHost));
      ++n;
    }
  }
  std::memcpy(send.data(), &n, sizeof(n));

  DeviceBytes<uint8_t> d_send, d_recv;
  EPMOE_CUDA_RETURN(cudaMalloc(&d_send.p, size_t(rank_bytes)));
  EPMOE_CUDA_RETURN(cudaMalloc(&d_recv.p, size_t(rank_bytes) * R));
  EPMOE_CUDA_RETURN(cudaMemcpy(d_send.p, send.data(), size_t(rank_bytes), cudaMemcpyHostToDevice));
  EPMOE_NCCL_RETURN(ncclAllGather(d_send.p, d_recv.p, size_t(rank_bytes), ncclUint8, comm.nccl(), stream));
  EPMOE_CUDA_RETURN(cudaStreamSynchronize(stream));
  std::vector<uint8_t> recv(size_t(rank_bytes) * R);
  EPMOE_CUDA_RETURN(cudaMemcpy(recv.data(), d_recv.p, recv.size(), cudaMemcpyDeviceToHost));

  for (int r = 0; r < R; ++r) {
    const uint8_t* base = recv.data() + int64_t(r) * rank_bytes;
    int64_t rows = 0;
    std::memcpy(&rows, base, sizeof(rows));
    if (rows < 0 || rows > capacity) {
      note("rank " + std::to_string(r) + " sent " + std::to_string(rows) + " rows");
      continue;
    }
    for (int64_t i = 0; i < rows; ++i) {
      const uint8_t* src = base + 16 + i * pk.row_bytes();
      uint32_t head[3];
      std::memcpy(head, src, sizeof(head));
      if (RowSource::rank(head[0]) != rank) continue;
      PoolRow pr;
      pr.src_rank = rank;
      pr.token = RowSource::token(head[0]);
      pr.slot = RowSource::slot(head[0]);
      pr.local_expert = int(head[1]);
      pr.owner = int(head[2]);
      pr.a_q.assign(src + pk.codes_at(), src + pk.codes_at() + p.I);
      pr.a_s.resize(size_t(p.I / 128));
      std::memcpy(pr.a_s.data(), src + pk.scales_at(), pr.a_s.size() * 4);
      pr.o.resize(size_t(p.H));
      std::memcpy(pr.o.data(), src + pk.o_at(), pr.o.size() * 2);
      mine->push_back(std::move(pr));
    }
  }
  std::sort(mine->begin(), mine->end(), [](const PoolRow& a, const PoolRow& b) {
    return a.token != b.token ? a.token < b.token : a.slot < b.slot;
  });
  return Status::Ok();
}

}  // namespace epmoe::e2e
