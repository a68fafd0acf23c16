// lift::cond and lift::switch_: the branch names, the selector, and the branches that did not run.
#include <linum/lift/cond.hpp>

#include <linum/core/error.hpp>

#include <cmath>

namespace linum::lift::detail {

std::string reserve_branch_name(Scope& s, const std::string& type_name) { return Pack::next_child_name(s, type_name); }

void mark_branch_used(Scope& s, const std::string& name) { Pack::mark_child_used(s, name); }

void throw_branch_error(const Scope& s, const char* transform, const std::string& what) {
  throw ValueError(linum::detail::cat(transform, " at '", s.path_str(), "': ", what));
}

std::int64_t read_selector(const Scope& s, const char* transform, const Array& selector, bool as_bool) {
  if (!selector.defined()) throw_branch_error(s, transform, "the selector is an undefined array");
  if (!selector.batch_levels().empty())
    throw_branch_error(s, transform,
                       linum::detail::cat("the selector is batched (one value per member of a lift::vmap, logical shape ",
                                          selector.shape(), "); a branch is chosen once per call, so select per member "
                                          "with where() on both branches' results instead"));
  if (selector.numel() != 1)
    throw_branch_error(s, transform,
                       linum::detail::cat("the selector has shape ", selector.shape(), " (", dtype_name(selector.dtype()),
                                          "); pass a scalar (one element)"));
  double v = 0;
  switch (selector.dtype()) {
    case DType::i32: v = selector.data_i32()[0]; break;
    default: v = selector.item(); break;
  }
  if (std::isnan(v)) throw_branch_error(s, transform, "the selector is NaN");
  if (as_bool) return v != 0 ? 1 : 0;
  if (v != static_cast<double>(static_cast<std::int64_t>(v)))
    throw_branch_error(s, transform, linum::detail::cat("the index ", v, " is not an integer; pass an int32 scalar"));
  return static_cast<std::int64_t>(v);
}

}  // namespace linum::lift::detail
