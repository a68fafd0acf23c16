// Small helpers for tests that check error messages.
#pragma once

#include <functional>
#include <string>

namespace linum::testing {

// The message of the exception of type E that f throws, or "<no exception>".
template <class E>
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "<no exception>";
}

inline bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace linum::testing
