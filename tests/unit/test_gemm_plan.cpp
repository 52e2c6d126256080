// GEMM plans on the CPU: plan_l1 / plan_l2 reject bad arguments before any CUDA call, and launch
// rejects an empty plan, so these run without a GPU or a driver. Every case here must fail in the
// host checks; a case that passed them would reach cudaGetDevice.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "host/gemm.h"

namespace {

using epmoe::DType;
using epmoe::StatusCode;
namespace gemm = epmoe::gemm;

// Fake, 16-byte aligned device addresses: the checks only look at them.
const void* const kP = reinterpret_cast<const void*>(256);
float* const kF = reinterpret_cast<float*>(512);
const int* const kCount = reinterpret_cast<const int*>(1024);
const int* const kOffset = reinterpret_cast<const int*>(2048);

gemm::GroupedArgs good_args() { return gemm::GroupedArgs{2, kCount, kOffset, 256, 256}; }

StatusCode l1_code(DType dt, const gemm::GroupedArgs& g, int hidden, int inter, float clamp = 0.0f,
                   const void* x = kP, const float* x_scale = kF) {
  gemm::GemmPlan plan;
  const auto st = gemm::plan_l1(dt, g, x, x_scale, kP, kF, kF, hidden, inter, clamp, false,
                                const_cast<void*>(kP), kF, &plan);
  EXPECT_EQ(plan.device, -1) << "a failed plan must leave *out alone";
  return st.code();
}

StatusCode l2_code(DType dt, const gemm::GroupedArgs& g, int inter, int hidden, const void* o = kP,
                   const float* w2_scale = kF) {
  gemm::GemmPlan plan;
  const auto st = gemm::plan_l2(dt, g, kP, kF, kP, w2_scale, inter, hidden, const_cast<void*>(o), &plan);
  EXPECT_EQ(plan.device, -1) << "a failed plan must leave *out alone";
  return st.code();
}

TEST(GemmPlan, RejectsBadShapes) {
  for (DType dt : {DType::kFP8, DType::kBF16}) {
    EXPECT_EQ(l2_code(dt, good_args(), 100, 256), StatusCode::kInvalidArgument);
    EXPECT_EQ(l2_code(dt, good_args(), 128, 0), StatusCode::kInvalidArgument);
    EXPECT_EQ(l1_code(dt, good_args(), 192, 128), StatusCode::kInvalidArgument);
    auto g = good_args();
    g.max_rows = 100;
    EXPECT_EQ(l2_code(dt, g, 128, 256), StatusCode::kInvalidArgument);
    g = good_args();
    g.max_rows = int64_t(1) << 31;
    EXPECT_EQ(l2_code(dt, g, 128, 256), StatusCode::kInvalidArgument);
    g = good_args();
    g.num_groups = 0;
    EXPECT_EQ(l1_code(dt, g, 128, 128), StatusCode::kInvalidArgument);
    g = good_args();
    g.num_groups = epmoe::Limits::kMaxExpertsPerRank + 1;  // the scheduler tables' size
    EXPECT_EQ(l1_code(dt, g, 128, 128), StatusCode::kInvalidArgument);
    EXPECT_EQ(l2_code(dt, g, 128, 256), StatusCode::kInvalidArgument);
    g = good_args();
    g.expert_offset = nullptr;
    EXPECT_EQ(l1_code(dt, g, 128, 128), StatusCode::kInvalidArgument);
  }
}

TEST(GemmPlan, RejectsBadScaleStride) {
  auto g = good_args();
  g.scale_stride = 128;  // below max_rows
  EXPECT_EQ(l1_code(DType::kFP8, g, 128, 128), StatusCode::kInvalidArgument);
  EXPECT_EQ(l2_code(DType::kFP8, g, 128, 128), StatusCode::kInvalidArgument);
  g.scale_stride = 258;  // not a multiple of 4
  EXPECT_EQ(l1_code(DType::kFP8, g, 128, 128), StatusCode::kInvalidArgument);
}

TEST(GemmPlan, RejectsBadPointers) {
  const auto g = good_args();
  EXPECT_EQ(l1_code(DType::kBF16, g, 128, 128, 0.0f, nullptr), StatusCode::kInvalidArgument);
  EXPECT_EQ(l1_code(DType::kBF16, g, 128, 128, 0.0f, reinterpret_cast<const void*>(264)),
            StatusCode::kInvalidArgument);  // 8-byte aligned only
  EXPECT_EQ(l1_code(DType::kFP8, g, 128, 128, 0.0f, kP, nullptr), StatusCode::kInvalidArgument);
  EXPECT_EQ(l2_code(DType::kBF16, g, 128, 128, nullptr), StatusCode::kInvalidArgument);
  EXPECT_EQ(l2_code(DType::kFP8, g, 128, 128, kP, nullptr), StatusCode::kInvalidArgument);
}

TEST(GemmPlan, RejectsNonFiniteClampAndNullOutput) {
  const auto g = good_args();
  EXPECT_EQ(l1_code(DType::kBF16, g, 128, 128, std::numeric_limits<float>::infinity()),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(l1_code(DType::kFP8, g, 128, 128, std::nanf("")), StatusCode::kInvalidArgument);
  EXPECT_EQ(gemm::plan_l1(DType::kBF16, g, kP, nullptr, kP, nullptr, kF, 128, 128, 0.0f, false,
                          const_cast<void*>(kP), nullptr, nullptr)
                .code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(gemm::plan_l2(DType::kBF16, g, kP, nullptr, kP, nullptr, 128, 128, const_cast<void*>(kP), nullptr)
                .code(),
            StatusCode::kInvalidArgument);
}

TEST(GemmPlan, LaunchRejectsEmptyPlan) {
  const gemm::GemmPlan empty;
  EXPECT_EQ(empty.device, -1);
  EXPECT_EQ(gemm::launch(empty, nullptr).code(), StatusCode::kInvalidArgument);
}

}  // namespace
