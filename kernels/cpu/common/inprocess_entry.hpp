// What the in-process entries (gemm_lib.cpp, grouped_conv_lib.cpp) share: the status codes
// they return, the reason copied into the caller's buffer, no exception crossing the C
// boundary, and the lookup of a compiled parameter. tilecast/kernel_library.py holds the
// same status table.
#pragma once

#include <algorithm>
#include <cstring>
#include <exception>
#include <new>
#include <string>
#include <vector>

#include "harness.hpp"

namespace tc::entry {

enum Status : int { kOk = 0, kBadArgument = 1, kUnsupported = 2, kOutOfMemory = 3, kFailed = 4 };

/// A status and, unless kOk, why.
struct Outcome {
  Status status = kOk;
  std::string reason;
};

/// Copies `text` into `message` (at most capacity bytes with the NUL; truncated to fit).
inline void copy_message(const std::string& text, char* message, long long capacity) {
  if (message == nullptr || capacity <= 0) return;
  const std::size_t length = std::min<std::size_t>(text.size(), std::size_t(capacity - 1));
  std::memcpy(message, text.data(), length);
  message[length] = '\0';
}

/// Runs body() -> Outcome; an exception becomes kOutOfMemory or kFailed with its text.
/// Returns the status, with the reason in `message`.
template <class Body>
int guarded(char* message, long long capacity, Body&& body) {
  Outcome outcome;
  try {
    outcome = body();
  } catch (const std::bad_alloc&) {
    outcome = {kOutOfMemory, "out of memory allocating the kernel's scratch"};
  } catch (const std::exception& error) {
    outcome = {kFailed, error.what()};
  } catch (...) {
    outcome = {kFailed, "non-standard exception"};
  }
  copy_message(outcome.reason, message, capacity);
  return outcome.status;
}

/// *value = the compiled parameter `name` (as --describe prints it); 0 if found, else 1.
inline int find_param(const std::vector<Param>& params, const char* name, long long* value) {
  if (name == nullptr || value == nullptr) return 1;
  for (const Param& param : params)
    if (param.name == name) {
      *value = param.value;
      return 0;
    }
  return 1;
}

}  // namespace tc::entry
