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
    return detail::lifted_run(scope, replayed, checkpoint, detail::LiftFilters{}, {}, keep_plain);
  }

  const RematScopeOptions& options() const { return *options_; }

 private:
  std::shared_ptr<const RematScopeOptions> options_;
};

RematScope::RematScope(RematScopeOptions options)
    : interceptor_(std::make_unique<Interceptor>(std::make_shared<const RematScopeOptions>(std::move(options)))),
      guard_(std::make_unique<linum::detail::CallInterceptorGuard>(interceptor_.get())) {}

RematScope::~RematScope() = default;

const RematScopeOptions& RematScope::options() const { return interceptor_->options(); }

}  // namespace linum::lift
