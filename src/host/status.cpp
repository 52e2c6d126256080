#include "epmoe/status.h"
#include "epmoe/version.h"

namespace epmoe {

const char* status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "Ok";
    case StatusCode::kInvalidArgument: return "InvalidArgument";
    case StatusCode::kUnsupported: return "Unsupported";
    case StatusCode::kCudaError: return "CudaError";
    case StatusCode::kNcclError: return "NcclError";
    case StatusCode::kTimeout: return "Timeout";
    case StatusCode::kInternal: return "Internal";
  }
  return "Unknown";
}

std::string Status::to_string() const {
  if (ok()) return "Ok";
  return std::string(status_code_name(code_)) + ": " + message_;
}

const char* version_string() { return "0.1.0"; }

}  // namespace epmoe
