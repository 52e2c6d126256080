// epmoe: status and error reporting.
#pragma once

#include <string>
#include <utility>

namespace epmoe {

/// Category of a failure. `kOk` means success.
enum class StatusCode {
  kOk = 0,
  kInvalidArgument,  ///< A field of the configuration or an input is out of its allowed range.
  kUnsupported,      ///< Valid in principle, but not supported by this build or this GPU.
  kCudaError,        ///< A CUDA runtime or driver call failed.
  kNcclError,        ///< An NCCL call failed, or NCCL lacks a feature epmoe needs.
  kTimeout,          ///< A bounded device-side wait expired (a peer never arrived).
  kInternal,         ///< A bug in epmoe.
};

/// The result of every fallible epmoe call: a code plus a message that names the bad field,
/// the value seen and the allowed range.
class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }
  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  /// "InvalidArgument: hidden=100 must be a positive multiple of 128".
  std::string to_string() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

const char* status_code_name(StatusCode code);

}  // namespace epmoe
