// Shared by the fuzz targets (tests/fuzz/): what a target may throw, and bitwise tree equality.
//
// A loader of outside data may refuse input only with a linum::Error (the message names the
// source and the entry); anything else escaping (std::length_error, nlohmann's exceptions, a
// crash, a sanitizer report, an allocation above the live-byte cap) is a bug the fuzzer reports.
#pragma once

#include <linum/core/error.hpp>
#include <linum/core/tree.hpp>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

namespace linum::fuzz {

// Every loader runs under this cap on live array bytes: an input may ask for any size, and must be
// refused with an error before it takes more than the bytes it could justify.
inline constexpr std::int64_t kLiveLimitBytes = std::int64_t{256} << 20;

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "fuzz property violated: %s\n", what);
  std::abort();
}

// Same structure, keys in order, shapes, dtypes and element bits (NaN payloads included).
inline bool same_bits(const Tree& a, const Tree& b) {
  if (a.is_leaf() != b.is_leaf()) return false;
  if (a.is_leaf()) return a.array().bitwise_equal(b.array());
  if (a.size() != b.size()) return false;
  for (auto ia = a.begin(), ib = b.begin(); ia != a.end(); ++ia, ++ib)
    if (ia->first != ib->first || !same_bits(ia->second, ib->second)) return false;
  return true;
}

}  // namespace linum::fuzz
