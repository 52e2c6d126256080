// Host-side error plumbing: turn CUDA and NCCL return codes into Status with the call site.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <sstream>
#include <string>

#include "epmoe/status.h"

namespace epmoe::detail {

inline Status cuda_status(cudaError_t err, const char* what, const char* file, int line) {
  if (err == cudaSuccess) return Status::Ok();
  std::ostringstream os;
  os << what << " failed: " << cudaGetErrorName(err) << " (" << cudaGetErrorString(err) << ") at "
     << file << ":" << line;
  return Status(StatusCode::kCudaError, os.str());
}

inline Status nccl_status(ncclResult_t res, const char* what, const char* file, int line) {
  if (res == ncclSuccess) return Status::Ok();
  std::ostringstream os;
  os << what << " failed: " << ncclGetErrorString(res) << " (" << static_cast<int>(res) << ") at "
     << file << ":" << line;
  return Status(StatusCode::kNcclError, os.str());
}

template <class... Args>
Status invalid(Args&&... args) {
  std::ostringstream os;
  (os << ... << args);
  return Status(StatusCode::kInvalidArgument, os.str());
}

}  // namespace epmoe::detail

// Return early from a Status-returning function when a call fails.
#define EPMOE_RETURN_IF_ERROR(expr)          \
  do {                                       \
    ::epmoe::Status _st = (expr);            \
    if (!_st.ok()) return _st;               \
  } while (0)
#define EPMOE_CUDA_RETURN(call) \
  EPMOE_RETURN_IF_ERROR(::epmoe::detail::cuda_status((call), #call, __FILE__, __LINE__))
#define EPMOE_NCCL_RETURN(call) \
  EPMOE_RETURN_IF_ERROR(::epmoe::detail::nccl_status((call), #call, __FILE__, __LINE__))
// After a kernel launch: the launch error, without synchronizing.
#define EPMOE_LAUNCH_CHECK(name) \
  EPMOE_RETURN_IF_ERROR(::epmoe::detail::cuda_status(cudaGetLastError(), "launch of " name, __FILE__, __LINE__))

namespace epmoe::detail {

// Makes `device` current until the end of the scope, then restores the caller's device (the caller
// is often a framework with its own notion of the current device).
class DeviceScope {
 public:
  DeviceScope() = default;
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  Status enter(int device) {
    EPMOE_CUDA_RETURN(cudaGetDevice(&prev_));
    if (prev_ != device) {
      EPMOE_CUDA_RETURN(cudaSetDevice(device));
      changed_ = true;
    }
    return Status::Ok();
  }
  ~DeviceScope() {
    if (changed_) (void)cudaSetDevice(prev_);
  }

 private:
  int prev_ = 0;
  bool changed_ = false;
};

}  // namespace epmoe::detail
