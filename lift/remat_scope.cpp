#include <linum/lift/remat_scope.hpp>

#include <linum/lift/remat.hpp>

#include <linum/core/warnings.hpp>

#include <algorithm>
#include <mutex>
#include <set>

namespace linum::lift {

// What a list_of_layers scope saw: the module calls, and which listed names matched one (shared by
// the scope's interceptor and those its checkpointed calls install for their bodies).
struct LayerMatches {
  std::mutex mutex;
  std::vector<std::string> called;  // the first few module paths seen, for the warning
  std::int64_t calls = 0;
  std::set<std::string> matched;
};

class RematScope::Interceptor final : public linum::detail::CallInterceptor {
 public:
  Interceptor(std::shared_ptr<const RematScopeOptions> options, std::shared_ptr<LayerMatches> matches)
      : options_(std::move(options)), matches_(std::move(matches)) {}

  bool wants(const std::vector<std::string>& path, const std::string& /*type*/) const override {
    switch (options_->mode) {
      case RematMode::none:
        return false;
      case RematMode::full:
      case RematMode::larger_than:
        return true;
      case RematMode::list_of_layers: {
        const auto& names = options_->layer_names;
        const std::string joined = linum::detail::join_module_path(path);
        std::lock_guard<std::mutex> lock(matches_->mutex);
        ++matches_->calls;
        if (matches_->called.size() < 8) matches_->called.push_back(joined);
        bool wanted = false;
        for (const std::string& name : {path.back(), joined})
          if (std::find(names.begin(), names.end(), name) != names.end()) {
            matches_->matched.insert(name);
            wanted = true;
          }
        return wanted;
      }
    }
    return false;
  }

  // Listed names that matched no module call so far.
  std::vector<std::string> unmatched() const {
    std::vector<std::string> out;
    std::lock_guard<std::mutex> lock(matches_->mutex);
    for (const auto& name : options_->layer_names)
      if (!matches_->matched.count(name)) out.push_back(name);
    return out;
  }
  std::int64_t calls_seen() const {
    std::lock_guard<std::mutex> lock(matches_->mutex);
    return matches_->calls;
  }
  std::vector<std::string> called() const {
    std::lock_guard<std::mutex> lock(matches_->mutex);
    return matches_->called;
  }

  std::vector<Array> run(Scope& scope, const std::function<std::vector<Array>(Scope&)>& body) override {
    // The call's body installs the same decisions again, so that its recomputation (which runs when
    // this scope may be long gone) checkpoints exactly the calls the forward pass checkpointed.
    detail::ScopedBody replayed = [options = options_, matches = matches_, body](Scope& s) {
      Interceptor again(options, matches);
      linum::detail::CallInterceptorGuard installed(&again);
      return body(s);
    };
    std::function<bool(const std::vector<Array>&)> keep_plain;
    if (options_->mode == RematMode::larger_than)
      keep_plain = [threshold = options_->output_size_threshold](const std::vector<Array>& outs) {
        std::int64_t elements = 0;
        for (const Array& a : outs) elements += a.numel();
        return !(elements > threshold);  // Keras: remat only if the size is strictly larger
      };
    CheckpointOptions checkpoint;
    checkpoint.policy = options_->policy;
    return detail::lifted_run(scope, replayed, checkpoint, LiftFilters{}, {}, keep_plain);
  }

  const RematScopeOptions& options() const { return *options_; }

 private:
  std::shared_ptr<const RematScopeOptions> options_;
  std::shared_ptr<LayerMatches> matches_;
};

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
    : interceptor_(std::make_unique<Interceptor>(std::make_shared<const RematScopeOptions>(validated(std::move(options))),
                                                 std::make_shared<LayerMatches>())),
      guard_(std::make_unique<linum::detail::CallInterceptorGuard>(interceptor_.get())) {}

// A layer list is legal even if a name matches nothing, but that is surely a typo or a renamed
// layer: say so when the scope ends (only if module calls were seen, so an unused scope is quiet).
RematScope::~RematScope() {
  guard_.reset();
  if (interceptor_->options().mode != RematMode::list_of_layers || interceptor_->calls_seen() == 0) return;
  const std::vector<std::string> missing = interceptor_->unmatched();
  if (missing.empty()) return;
  std::string names, seen;
  for (const auto& n : missing) names += (names.empty() ? "'" : ", '") + n + "'";
  for (const auto& c : interceptor_->called()) seen += (seen.empty() ? "" : ", ") + c;
  try {
    warn(linum::detail::cat("lift::RematScope (list_of_layers): ", names, " matched none of the ",
                            interceptor_->calls_seen(), " module calls made while the scope was alive (e.g. ", seen,
                            "), so nothing was rematerialized for them; use module names such as \"Dense_1\" or paths such "
                            "as \"Block_0/Dense_1\""));
  } catch (...) {  // a destructor must not throw; a handler that throws is ignored here
  }
}

std::vector<std::string> RematScope::unmatched_layer_names() const { return interceptor_->unmatched(); }

const RematScopeOptions& RematScope::options() const { return interceptor_->options(); }

}  // namespace linum::lift
