// Linum's exceptions. Library code never aborts: misuse is reported by throwing one of these, with
// a message that names the op or module path and the shapes involved, and says what to do next.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace linum {

// Base of every error Linum throws on bad input.
struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Shapes, ranks, axes or dtypes that an op cannot accept.
struct ShapeError : Error {
  using Error::Error;
};

// A value that an op or API cannot accept (out-of-range index, unknown name, bad option).
struct ValueError : Error {
  using Error::Error;
};

// Reading or writing files: missing, truncated or corrupt data.
struct IoError : Error {
  using Error::Error;
};

// Misuse of the autodiff API (differentiating a non-scalar, reusing a consumed graph, ...).
struct AutodiffError : Error {
  using Error::Error;
};

// An allocation the machine cannot satisfy, or one that would take live array bytes above the
// limit set with memory::set_live_limit. Names the array's shape and dtype.
struct MemoryError : Error {
  using Error::Error;
};

// A NaN or infinity found by debug_nans / debug_infs (core/debug_nans.hpp).
struct FloatingPointError : Error {
  using Error::Error;
};

namespace detail {
// Concatenates anything streamable into a message: cat("op ", name, ": got ", shape).
template <class... Parts>
std::string cat(Parts&&... parts) {
  std::ostringstream os;
  (os << ... << std::forward<Parts>(parts));
  return os.str();
}
}  // namespace detail

}  // namespace linum
