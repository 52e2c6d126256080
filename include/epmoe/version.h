// epmoe: version and run-time environment checks.
#pragma once

#include "epmoe/status.h"

namespace epmoe {

/// The NCCL version code epmoe needs at run time (2.28.9: symmetric windows and the device API).
inline constexpr int kMinNcclVersionCode = 22809;

/// Reads ncclGetVersion() from the libnccl that the loader picked. Fails with a message that
/// says which version loaded and how to point the loader at a good one.
Status check_nccl_runtime_version(int* loaded_code = nullptr);

const char* version_string();

}  // namespace epmoe
