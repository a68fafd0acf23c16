#include <linum/lift/pack.hpp>

namespace linum::lift::detail {

Pack::Pack(Scope& s, const LiftFilters& filters, std::string_view transform)
    : outer_(&s.state()), path_(s.path()) {
  const std::string where = s.path().empty() ? std::string("<root>") : linum::detail::join_module_path(s.path());
  linum::detail::LiftSelection selection{filters.collections, filters.streams,
                                         linum::detail::cat(transform, " at '", where, "'")};
  entry_ = std::make_shared<const ScopeState>(outer_->lifted(path_, selection));
}

}  // namespace linum::lift::detail
