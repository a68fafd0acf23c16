#include <linum/lift/remat_scope.hpp>

#include <linum/lift/remat_rule.hpp>

#include <linum/core/warnings.hpp>

#include <algorithm>
#include <mutex>
#include <set>

namespace linum::lift {

namespace detail {

// What a list_of_layers scope saw: the module calls, and which listed names matched one (shared by
// the scope's rule and the copies its checkpointed calls install for their bodies).
struct LayerMatches {
  std::mutex mutex;
  std::vector<std::string> called;  // the first few module paths seen, for the warning
  std::int64_t calls = 0;
  std::set<std::string> matched;
};

}  // namespace detail

namespace {

// Keras's modes as a rule over module paths.
detail::RematRule mode_rule(std::shared_ptr<const RematScopeOptions> options, std::shared_ptr<detail::LayerMatches> matches) {
  return [options, matches](const std::vector<std::string>& path) -> std::optional<detail::RematDecision> {
    detail::RematDecision checkpointed{.policy = options->policy, .keep_plain = {}};
    switch (options->mode) {
      case RematMode::none:
        return std::nullopt;
      case RematMode::full:
        return checkpointed;
      case RematMode::larger_than:
        checkpointed.keep_plain = [threshold = options->output_size_threshold](const std::vector<Array>& outs) {
          std::int64_t elements = 0;
          for (const Array& a : outs) elements += a.numel();
          return !(elements > threshold);  // Keras: remat only if the size is strictly larger
        };
        return checkpointed;
      case RematMode::list_of_layers: {
        const auto& names = options->layer_names;
        const std::string joined = linum::detail::join_module_path(path);
        std::lock_guard<std::mutex> lock(matches->mutex);
        ++matches->calls;
        if (matches->called.size() < 8) matches->called.push_back(joined);
        bool wanted = false;
        for (const std::string& name : {path.back(), joined})
          if (std::find(names.begin(), names.end(), name) != names.end()) {
            matches->matched.insert(name);
            wanted = true;
          }
        if (wanted) return checkpointed;
        return std::nullopt;
      }
    }
    return std::nullopt;
  };
}

}  // namespace

namespace {
// Options that cannot mean what the user wants are refused (Keras accepts several of them silently).
RematScopeOptions validated(RematScopeOptions o) {
  const int mode = static_cast<int>(o.mode);
  if (mode < static_cast<int>(RematMode::none) || mode > static_cast<int>(RematMode::list_of_layers))
    throw ValueError(linum::detail::cat("RematScope: mode ", mode, " is not a RematMode (none, full, larger_than, list_of_layers)"));
  if (o.output_size_threshold < 0)
    throw ValueError(linum::detail::cat("RematScope: output_size_threshold must be >= 0 elements, got ", o.output_size_threshold));
  if (o.mode == RematMode::list_of_layers && o.layer_names.empty())
    throw ValueError("RematScope: list_of_layers needs layer_names (module names such as \"Dense_0\" or paths such as "
                     "\"Encoder_0/Block_1\"); with no names nothing would be rematerialized");
  if (o.mode != RematMode::list_of_layers && !o.layer_names.empty())
    throw ValueError("RematScope: layer_names are only used with mode = list_of_layers; set that mode or drop the names");
  for (const auto& name : o.layer_names)
    if (name.empty()) throw ValueError("RematScope: an entry of layer_names is empty");
  return o;
}
}  // namespace

RematScope::RematScope(RematScopeOptions options)
    : options_(std::make_shared<const RematScopeOptions>(validated(std::move(options)))),
      matches_(std::make_shared<detail::LayerMatches>()),
      scope_(std::make_unique<detail::RematRuleScope>(mode_rule(options_, matches_))) {}

// A layer list is legal even if a name matches nothing, but that is surely a typo or a renamed
// layer: say so when the scope ends (only if module calls were seen, so an unused scope is quiet).
RematScope::~RematScope() {
  scope_.reset();
  if (options_->mode != RematMode::list_of_layers) return;
  std::int64_t calls = 0;
  std::string seen;
  {
    std::lock_guard<std::mutex> lock(matches_->mutex);
    calls = matches_->calls;
    for (const auto& c : matches_->called) seen += (seen.empty() ? "" : ", ") + c;
  }
  if (calls == 0) return;
  const std::vector<std::string> missing = unmatched_layer_names();
  if (missing.empty()) return;
  std::string names;
  for (const auto& n : missing) names += (names.empty() ? "'" : ", '") + n + "'";
  try {
    warn(linum::detail::cat("lift::RematScope (list_of_layers): ", names, " matched none of the ", calls,
                            " module calls made while the scope was alive (e.g. ", seen,
                            "), so nothing was rematerialized for them; use module names such as \"Dense_1\" or paths such "
                            "as \"Block_0/Dense_1\""));
  } catch (...) {  // a destructor must not throw; a handler that throws is ignored here
  }
}

std::vector<std::string> RematScope::unmatched_layer_names() const {
  std::vector<std::string> out;
  std::lock_guard<std::mutex> lock(matches_->mutex);
  for (const auto& name : options_->layer_names)
    if (!matches_->matched.count(name)) out.push_back(name);
  return out;
}

const RematScopeOptions& RematScope::options() const { return *options_; }

}  // namespace linum::lift
