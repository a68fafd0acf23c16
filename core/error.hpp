// Linum's exceptions. Library code never aborts: misuse is reported by throwing one of these, with
// a message that names the op or module path and the shapes involved, and says what to do next.
#pragma once

#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace linum {

// Base of every error Linum throws on bad input. An error raised inside a module learns, as it
// leaves the innermost module, where it happened: its message starts "in module 'path' (Type): "
// and module_path() says the path. The exception keeps its type on the way (a ShapeError stays a
// ShapeError, a dist::DistError a DistError): the context is added to the object, not re-thrown
// as a new one.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what), message_(std::make_shared<std::string>(what)) {}
  explicit Error(const char* what) : Error(std::string(what)) {}
  const char* what() const noexcept override { return message_->c_str(); }
  // The path of the innermost module the error was raised in, as the message prints it
  // ("Encoder_0/Dense_1", "<root>" for the top module); empty when raised outside modules.
  const std::string& module_path() const noexcept { return *module_path_; }
  bool in_module() const noexcept { return in_module_; }
  // Records the innermost module (once: outer modules leave it as it is).
  void set_module(const std::string& path, const std::string& type_name) {
    if (in_module_) return;
    in_module_ = true;
    module_path_ = std::make_shared<const std::string>(path);
    message_ = std::make_shared<std::string>("in module '" + path + "' (" + type_name + "): " + *message_);
  }

 private:
  // Shared, so copying an exception never throws (as std::runtime_error's own string).
  std::shared_ptr<std::string> message_;
  std::shared_ptr<const std::string> module_path_ = std::make_shared<const std::string>();
  bool in_module_ = false;
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

// vmap (core/transforms/vmap.hpp): a value that differs per example read where one value is needed
// (item(), to_vector(), a kernel of an op with no batching rule), batch sizes that disagree, an
// out axis that cannot hold the result.
struct BatchingError : Error {
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
