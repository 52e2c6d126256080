#include "e2e/fp8_check.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <sstream>
#include <thread>

#include "reference/numeric.h"

namespace epmoe::e2e {

namespace {

// One sampled token's share of the check.
struct TokenResult {
  std::vector<uint16_t> y_ref, y_kc;
  ref::RequantCheck requant;
  int64_t groups = 0, o_checked = 0, o_bad = 0, o_flips = 0, y_checked = 0, y_bad = 0, rows_bad = 0;
  std::string first_bad;
  void note(const std::string& s) {
    if (first_bad.empty()) first_bad = s;
  }
};

void check_token(const ref::Problem& p, int rank, int t, const uint16_t* y_row, const std::vector<const PoolRow*>& rows,
                 const ref::RankInput& in, const std::vector<ref::RankWeights>& weights, bool bf16_partials,
                 TokenResult* out) {
  TokenResult& res = *out;
  const int H = p.H, I = p.I, E_loc = p.E_loc();
  std::vector<double> x_hat(H), h_abs(2 * I), da(I), a_hat(I), v64(H), v_abs(H);
  std::vector<float> h(2 * I), a(I);
  std::vector<uint16_t> o_ref(H), o_kc(H);
  std::vector<std::vector<uint16_t>> o_ref_rows, o_kc_rows;
  std::vector<int> kc_owner;  // the rank whose expert produced each o_kc row
  std::vector<double> gpu_sum(H, 0.0), gpu_abs(H, 0.0);
  int slots = 0;
  ref::dequant_input_row(p, in.x.data() + int64_t(t) * H, x_hat.data());
  for (int k = 0; k < p.K; ++k) {
    const int32_t e = in.topk_idx[int64_t(t) * p.K + k];
    if (e < 0) continue;
    ++slots;
    const ref::RankWeights& w = weights[e / E_loc];
    const int le = e % E_loc;
    const float weight = in.topk_w[int64_t(t) * p.K + k];
    // The reference's steps 2-6 (SPEC's y_ref), with the sizes of the sums.
    ref::gemm1_row_abs(p, w, le, x_hat.data(), h.data(), h_abs.data());
    ref::swiglu_row(h.data(), I, p.clamp, weight, a.data());
    ref::requant_act_row(p, a.data(), a_hat.data());
    ref::gemm2_row(p, w, le, a_hat.data(), o_ref.data());
    o_ref_rows.push_back(o_ref);
    res.groups += I / ref::kQuantGroup;

    std::ostringstream where;
    where << "rank " << rank << " token " << t << " slot " << k << " (expert " << e << ")";
    const PoolRow* row = nullptr;
    int found = 0;
    for (const PoolRow* r : rows)
      if (r->slot == k) {
        row = r;
        ++found;
      }
    if (found != 1) {
      ++res.rows_bad;
      res.note(where.str() + ": " + std::to_string(found) + " pool rows, expected 1");
      continue;
    }
    if (row->owner != e / E_loc || row->local_expert != le) {
      ++res.rows_bad;
      res.note(where.str() + ": its pool row is in rank " + std::to_string(row->owner) + "'s expert " +
               std::to_string(row->local_expert) + " segment");
      continue;
    }

    // Step 5: the GPU's codes and scales against the reference's a.
    ref::act_error_bound(h.data(), h_abs.data(), I, p.clamp, weight, ref::kGemmAccumError, da.data());
    ref::check_requant_row(a.data(), da.data(), row->a_q.data(), row->a_s.data(), I, p.pow2_scales, where.str(),
                           &res.requant);

    // Step 6 on the GPU's own a^: o = bf16(W2 a^), its fp32 accumulation within the GEMM error.
    for (int i = 0; i < I; ++i)
      a_hat[i] = ref::e4m3_table()[row->a_q[i]] * double(row->a_s[i / ref::kQuantGroup]);
    ref::gemm2_row_abs(p, w, le, a_hat.data(), v64.data(), o_kc.data(), v_abs.data());
    o_kc_rows.push_back(o_kc);
    kc_owner.push_back(e / E_loc);
    for (int j = 0; j < H; ++j) {
      ++res.o_checked;
      const uint16_t got = row->o[j];
      if (!ref::bf16_within(got, v64[j], ref::gemm_error_window(v_abs[j], I, ref::kGemm2AccumError))) {
        if (!res.o_bad++) {
          std::ostringstream os;
          os.precision(9);
          os << where.str() << " channel " << j << ": o " << ref::bf16_to_float(got) << " vs W2 a^ = " << v64[j]
             << " (window " << ref::gemm_error_window(v_abs[j], I, ref::kGemm2AccumError) << ")";
          res.note(os.str());
        }
      } else if (got != o_kc[j]) {
        ++res.o_flips;
      }
      const double g = ref::bf16_to_float(got);
      gpu_sum[j] += g;
      gpu_abs[j] += std::fabs(g);
    }
  }

  // Step 7: y against the GPU's own o rows.
  for (int j = 0; j < H; ++j) {
    ++res.y_checked;
    const bool ok = slots == 0 ? ref::bf16_to_float(y_row[j]) == 0.0f
                               : ref::bf16_within(y_row[j], gpu_sum[j],
                                                  ref::combine_error_window(gpu_abs[j], slots, bf16_partials));
    if (!ok && !res.y_bad++) {
      std::ostringstream os;
      os.precision(9);
      os << "rank " << rank << " token " << t << " channel " << j << ": y " << ref::bf16_to_float(y_row[j])
         << " vs the sum of the pool's o rows " << gpu_sum[j] << " (" << slots << " slots)";
      res.note(os.str());
    }
  }

  // The reference's step 7 on the reference's o (SPEC's y_ref) and on the GPU-consistent o.
  std::vector<const uint16_t*> ref_ptrs, kc_ptrs;
  for (const auto& r : o_ref_rows) ref_ptrs.push_back(r.data());
  for (const auto& r : o_kc_rows) kc_ptrs.push_back(r.data());
  res.y_ref.resize(H);
  res.y_kc.resize(H);
  ref::combine_row(ref_ptrs, H, res.y_ref.data());
  if (!bf16_partials) {
    ref::combine_row(kc_ptrs, H, res.y_kc.data());
    return;
  }
  // bf16 partials (LayerConfig::combine_partials): each rank's experts' outputs are summed in
  // fp32 and rounded to bf16 before the final fp32 sum, so the kernel-consistent y does the same.
  for (int j = 0; j < H; ++j) {
    float total = 0.0f;
    bool any = false;
    for (int r = 0; r < p.R; ++r) {
      float part = 0.0f;
      bool has = false;
      for (size_t i = 0; i < o_kc_rows.size(); ++i) {
        if (kc_owner[i] != r) continue;
        const float v = ref::bf16_to_float(o_kc_rows[i][j]);
        part = has ? part + v : v;
        has = true;
      }
      if (!has) continue;
      const float rounded = ref::bf16_to_float(ref::bf16_from_float(part));
      total = any ? total + rounded : rounded;
      any = true;
    }
    res.y_kc[j] = any ? ref::bf16_from_float(total) : uint16_t{0};
  }
}

}  // namespace

Fp8CallCheck check_fp8_call(const ref::Problem& p, int rank, const std::vector<int>& sample,
                            const std::vector<uint16_t>& y, const std::vector<PoolRow>& rows,
                            const std::vector<ref::RankInput>& inputs, const std::vector<ref::RankWeights>& weights,
                            bool bf16_partials) {
  const ref::RankInput& in = inputs[rank];
  std::vector<TokenResult> res(sample.size());
  std::vector<std::vector<const PoolRow*>> token_rows(sample.size());
  for (const PoolRow& r : rows) {
    const auto it = std::lower_bound(sample.begin(), sample.end(), r.token);
    if (it != sample.end() && *it == r.token) token_rows[it - sample.begin()].push_back(&r);
  }
  std::atomic<size_t> next{0};
  auto worker = [&] {
    for (size_t i = next++; i < sample.size(); i = next++)
      check_token(p, rank, sample[i], y.data() + int64_t(sample[i]) * p.H, token_rows[i], in, weights, bf16_partials,
                  &res[i]);
  };
  const int n_threads = int(std::min<size_t>(ref::worker_threads(), std::max<size_t>(sample.size(), 1)));
  std::vector<std::thread> pool;
  for (int i = 1; i < n_threads; ++i) pool.emplace_back(worker);
  worker();
  for (auto& th : pool) th.join();

  Fp8CallCheck c;
  std::vector<uint16_t> got, want, kc;
  for (size_t i = 0; i < sample.size(); ++i) {
    const TokenResult& r = res[i];
    const uint16_t* y_row = y.data() + int64_t(sample[i]) * p.H;
    got.insert(got.end(), y_row, y_row + p.H);
    want.insert(want.end(), r.y_ref.begin(), r.y_ref.end());
    kc.insert(kc.end(), r.y_kc.begin(), r.y_kc.end());
    double err2 = 0.0, ref2 = 0.0;
    for (int j = 0; j < p.H; ++j) {
      const double g = ref::bf16_to_float(y_row[j]), w = ref::bf16_to_float(r.y_ref[j]);
      err2 += (g - w) * (g - w);
      ref2 += w * w;
    }
    c.token_err2.push_back(err2);
    c.token_ref2.push_back(ref2);
    c.groups += r.groups;
    c.requant.merge(r.requant);
    c.o_checked += r.o_checked;
    c.o_bad += r.o_bad;
    c.o_flips += r.o_flips;
    c.y_checked += r.y_checked;
    c.y_bad += r.y_bad;
    c.rows_bad += r.rows_bad;
    if (c.first_bad.empty()) c.first_bad = r.first_bad;
  }
  if (c.first_bad.empty()) c.first_bad = c.requant.first_bad;
  c.full = ref::compare_bf16(got.data(), want.data(), int64_t(got.size()));
  c.kc = ref::compare_bf16(got.data(), kc.data(), int64_t(got.size()));
  return c;
}

}  // namespace epmoe::e2e
