// The C boundary's error convention (include/epmoe/c_api.h): a call returns its epmoe::StatusCode
// (0 is success), keeps the message of the calling thread's last failure, and lets no C++ exception
// cross. Shared by the library's C ABI (c_api.cpp) and the benchmark's ctypes library
// (bench/ctypes/gemm_ctypes.cpp), each with its own thread-local message.
#pragma once

#include <exception>
#include <string>

#include "epmoe/status.h"

namespace epmoe::detail {

// st's code; a failure's message goes to last_error.
inline int record_status(const Status& st, std::string& last_error) {
  if (st.ok()) return 0;
  last_error = st.message();
  return static_cast<int>(st.code());
}

// Runs `body` (returning Status) and records its result; an exception becomes kInternal.
template <class Body>
int guarded_call(std::string& last_error, Body&& body) {
  try {
    return record_status(body(), last_error);
  } catch (const std::exception& e) {
    return record_status(Status(StatusCode::kInternal, std::string("unexpected C++ exception: ") + e.what()),
                         last_error);
  } catch (...) {
    return record_status(Status(StatusCode::kInternal, "unexpected non-standard C++ exception"), last_error);
  }
}

}  // namespace epmoe::detail
