#include <linum/lift/remat_scope.hpp>

#include <linum/lift/remat.hpp>

#include <algorithm>

namespace linum::lift {

class RematScope::Interceptor final : public linum::detail::CallInterceptor {
 public:
  explicit Interceptor(std::shared_ptr<const RematScopeOptions> options) : options_(std::move(options)) {}

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
        return std::find(names.begin(), names.end(), path.back()) != names.end() ||
               std::find(names.begin(), names.end(), joined) != names.end();
      }
    }
    return false;
  }

  std::vector<Array> run(Scope& scope, const std::function<std::vector<Array>(Scope&)>& body) override {
    // The call's body installs the same decisions again, so that its recomputation (which runs when
    // this scope may be long gone) checkpoints exactly the calls the forward pass checkpointed.
    detail::ScopedBody replayed = [options = options_, body](Scope& s) {
      Interceptor again(options);
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
    : interceptor_(std::make_unique<Interceptor>(std::make_shared<const RematScopeOptions>(validated(std::move(options))))),
      guard_(std::make_unique<linum::detail::CallInterceptorGuard>(interceptor_.get())) {}

RematScope::~RematScope() = default;

const RematScopeOptions& RematScope::options() const { return interceptor_->options(); }

}  // namespace linum::lift
