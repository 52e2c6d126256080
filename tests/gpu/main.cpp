#include <gtest/gtest.h>

#include <cstdio>

#include "gpu/gpu_test_util.h"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  int gpus = epmoe::test::visible_gpus();
  if (gpus == 0) std::printf("[epmoe] no GPU visible: GPU tests will be skipped\n");
  return RUN_ALL_TESTS();
}
