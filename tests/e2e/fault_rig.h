// The rig of the layer's fault-injection cases (test_layer_faults.cpp, test_layer_departures.cpp):
// one rank's small BF16 layer with random weights and the inputs of a call, the shared-memory
// counters through which ranks tell each other what they checked, and the launch of one case at
// mgpu::test_ranks(2) ranks within its time bound.
#pragma once

#include <gtest/gtest.h>
#include <sys/mman.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "epmoe/comm.h"
#include "epmoe/launcher.h"
#include "epmoe/layer.h"
#include "mgpu/mgpu_util.h"

namespace epmoe::e2e::faults {

inline constexpr double kWaitSeconds = 1.0;    // LayerConfig::timeout_seconds in the timeout cases
inline constexpr double kLaunchSeconds = 40.0;  // the launcher kills every rank after this
inline constexpr double kEndWithin = 30.0;      // what each case must take at most

template <class T>
struct DevBuf {
  T* p = nullptr;
  ~DevBuf() { if (p) cudaFree(p); }
  DevBuf() = default;
  DevBuf(const DevBuf&) = delete;
  cudaError_t alloc(size_t n) { return cudaMalloc(&p, n * sizeof(T)); }
  cudaError_t upload(const std::vector<T>& v) {
    const cudaError_t e = alloc(v.size());
    return e != cudaSuccess ? e : cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
};

inline uint16_t bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// Deterministic values in [-scale, scale).
inline std::vector<uint16_t> random_bf16(size_t n, uint64_t seed, float scale) {
  std::vector<uint16_t> v(n);
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (auto& x : v) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    x = bf16(scale * (float((s >> 40) & 0xFFFF) / 32768.0f - 1.0f));
  }
  return v;
}

// One rank's small BF16 layer with random weights, and the inputs of one call.
struct Rig {
  LayerConfig cfg;
  std::unique_ptr<Communicator> comm;
  std::unique_ptr<MoELayer> layer;
  cudaStream_t stream = nullptr;
  DevBuf<uint16_t> w1, w2, x, y;
  DevBuf<int32_t> idx;
  DevBuf<float> wt;
  int T = 16;
  ~Rig() { if (stream) cudaStreamDestroy(stream); }
};

inline LayerConfig small_config(int ranks, double timeout_s) {
  LayerConfig cfg;
  cfg.num_ranks = ranks;
  cfg.num_experts = 2 * ranks;
  cfg.hidden = 512;
  cfg.intermediate = 256;
  cfg.topk = 2;
  cfg.max_tokens_per_rank = 64;
  cfg.dtype = DType::kBF16;
  cfg.timeout_seconds = timeout_s;
  return cfg;
}

inline std::vector<int32_t> routing(const LayerConfig& cfg, int T, int rank, int variant) {
  std::vector<int32_t> idx(size_t(T) * cfg.topk);
  for (int t = 0; t < T; ++t)
    for (int k = 0; k < cfg.topk; ++k)
      idx[size_t(t) * cfg.topk + k] = (t * 3 + k * 5 + rank + variant) % cfg.num_experts;
  return idx;
}

inline Status load_inputs(Rig& r, int rank, int variant) {
  const int T = r.T, K = r.cfg.topk, H = r.cfg.hidden;
  RANK_CUDA(r.x.upload(random_bf16(size_t(T) * H, 1000 + rank * 7 + variant, 1.0f)));
  RANK_CUDA(r.idx.upload(routing(r.cfg, T, rank, variant)));
  std::vector<float> w(size_t(T) * K, 0.5f);
  RANK_CUDA(r.wt.upload(w));
  RANK_CUDA(r.y.alloc(size_t(T) * H));
  RANK_CUDA(cudaMemset(r.y.p, 0, size_t(T) * H * 2));
  return Status::Ok();
}

inline Status make_rig(const RankContext& ctx, const LayerConfig& cfg, Rig* r) {
  r->cfg = cfg;
  RANK_OK(mgpu::make_comm(ctx, &r->comm));
  RANK_OK(MoELayer::create(*r->comm, cfg, &r->layer));
  RANK_CUDA(cudaStreamCreateWithFlags(&r->stream, cudaStreamNonBlocking));
  const int g = cfg.experts_per_rank(), h = cfg.hidden, in = cfg.intermediate;
  RANK_CUDA(r->w1.upload(random_bf16(size_t(g) * 2 * in * h, 17 + ctx.rank, 0.05f)));
  RANK_CUDA(r->w2.upload(random_bf16(size_t(g) * h * in, 29 + ctx.rank, 0.05f)));
  ExpertWeights w;
  w.w1 = r->w1.p;
  w.w2 = r->w2.p;
  w.on_device = true;
  RANK_OK(r->layer->load_weights(w, r->stream));
  return load_inputs(*r, ctx.rank, 0);
}

inline Status forward(Rig& r, Path path, cudaStream_t stream = nullptr) {
  return r.layer->forward(r.x.p, r.idx.p, r.wt.p, r.y.p, r.T, stream ? stream : r.stream, path);
}

inline std::vector<uint16_t> download(const DevBuf<uint16_t>& b, size_t n) {
  std::vector<uint16_t> h(n);
  if (cudaMemcpy(h.data(), b.p, n * 2, cudaMemcpyDeviceToHost) != cudaSuccess) h.clear();
  return h;
}

inline bool contains(const std::string& s, const std::string& what) { return s.find(what) != std::string::npos; }

// Ranks that report through shared memory that they checked their Status: the faulty rank stays
// alive (its memory mapped for the peers' NVLink writes) until every peer did, or a deadline.
class Checked {
 public:
  Checked() {
    void* m = mmap(nullptr, sizeof(int), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    count_ = m == MAP_FAILED ? nullptr : static_cast<int*>(m);
    if (count_) *count_ = 0;
  }
  ~Checked() { if (count_) munmap(count_, sizeof(int)); }
  bool ok() const { return count_ != nullptr; }
  void mark() { __atomic_add_fetch(count_, 1, __ATOMIC_SEQ_CST); }
  bool wait_for(int n, double seconds) const {
    const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    while (__atomic_load_n(count_, __ATOMIC_SEQ_CST) < n) {
      if (std::chrono::steady_clock::now() > end) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return true;
  }

 private:
  int* count_ = nullptr;
};

// Runs `fn` on test_ranks(2) ranks; the case must end within kEndWithin. `expected_exits`: ranks
// that end by _exit in the middle of the case (LaunchOptions::expected_exits).
inline void run_case(const char* name, const std::function<Status(const RankContext&)>& fn,
              const std::vector<ExpectedExit>& expected_exits = {}) {
  const int ranks = mgpu::test_ranks(2);
  if (ranks < 2) GTEST_SKIP() << "fault injection needs >= 2 ranks (EPMOE_TEST_RANKS)";
  EPMOE_REQUIRE_RANKS(ranks);
  const auto t0 = std::chrono::steady_clock::now();
  LaunchOptions o;
  o.num_ranks = ranks;
  o.timeout_seconds = kLaunchSeconds;
  o.expected_exits = expected_exits;
  const LaunchResult r = launch_ranks(o, fn);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("[faults] %s at R=%d: %.1f s\n", name, ranks, s);
  ASSERT_TRUE(r.ok) << r.message;
  EXPECT_LT(s, kEndWithin);
}

inline const char* path_name(Path p) { return p == Path::kFused ? "fused" : "pipeline"; }

// After a trap on some rank, the next forward returns its record without a sync. Calls forward
// until it fails (the record may land a little after the first call returned), then checks.
inline Status timeout_without_sync(Rig& r, Path path, const Status& first, Status* out) {
  Status st = first;
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(kWaitSeconds * 10 + 5);
  while (st.ok() && std::chrono::steady_clock::now() < end) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    st = forward(r, path);
  }
  *out = st;
  return Status::Ok();
}

}  // namespace epmoe::e2e::faults
