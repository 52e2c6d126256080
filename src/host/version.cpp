#include <nccl.h>

#include "epmoe/version.h"
#include "host/check.h"

namespace epmoe {

Status check_nccl_runtime_version(int* loaded_code) {
  int code = 0;
  EPMOE_NCCL_RETURN(ncclGetVersion(&code));
  if (loaded_code) *loaded_code = code;
  if (code < kMinNcclVersionCode) {
    std::ostringstream os;
    os << "the loaded libnccl reports version code " << code << " but epmoe needs >= "
       << kMinNcclVersionCode << " (NCCL 2.28.9; compiled against " << NCCL_VERSION_CODE
       << "). Older 2.28.x builds are ABI-incompatible with the device API and fault. "
       << "Point the loader at a newer libnccl.so.2 (LD_LIBRARY_PATH, or rebuild with "
       << "-DEPMOE_EXTRA_RPATH=<dir>).";
    return Status(StatusCode::kNcclError, os.str());
  }
  return Status::Ok();
}

}  // namespace epmoe
