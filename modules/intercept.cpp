#include <linum/modules/intercept.hpp>

#include <linum/core/error.hpp>

namespace linum {

std::string MethodCall::path_str() const { return detail::join_module_path(call_.path); }

std::vector<Array> MethodCall::arguments() const {
  if (!call_.arguments) return {};
  std::vector<Array> arrays = call_.arguments->take();
  call_.arguments->put_back(arrays);
  return arrays;
}

void MethodCall::set_arguments(std::span<const Array> arrays) {
  if (!call_.arguments) {
    if (arrays.empty()) return;
    throw ValueError(detail::cat("intercept_methods: the call of '", path_str(), "' (", call_.type, ") has no input arrays; ",
                                 "set_arguments got ", arrays.size()));
  }
  const std::vector<Array> old = call_.arguments->take();
  if (old.size() != arrays.size()) {
    call_.arguments->put_back(old);
    throw ValueError(detail::cat("intercept_methods: the call of '", path_str(), "' (", call_.type, ") takes ", old.size(),
                                 " input arrays; set_arguments got ", arrays.size(), " (pass one per array arguments() gave)"));
  }
  call_.arguments->put_back(arrays);
}

struct InterceptMethods::Hook final : detail::ModuleCallHook {
  explicit Hook(MethodInterceptor f) : interceptor(std::move(f)) {}
  bool wants(const detail::ModuleCall&) const override { return true; }
  std::vector<Array> around(Scope& scope, const detail::ModuleCall& call, const detail::ModuleCallBody& next,
                            const detail::ModuleCallBody&) override {
    MethodCall view(call);
    bool ran = false;
    std::size_t produced = 0;
    const std::function<std::vector<Array>()> run = [&] {
      if (ran)
        throw ValueError(detail::cat("intercept_methods: the interceptor ran the call of '", view.path_str(), "' (", call.type,
                                     ") twice; call next() once"));
      ran = true;
      std::vector<Array> out = next(scope);
      produced = out.size();
      return out;
    };
    std::vector<Array> out = interceptor(view, run);
    if (!ran)
      throw ValueError(detail::cat("intercept_methods: the interceptor returned without running the call of '", view.path_str(),
                                   "' (", call.type, "); call next() and return its arrays (changed or not)"));
    if (out.size() != produced)
      throw ValueError(detail::cat("intercept_methods: the call of '", view.path_str(), "' (", call.type, ") returns ", produced,
                                   " arrays but the interceptor returned ", out.size(), "; return one per array next() gave"));
    return out;
  }
  MethodInterceptor interceptor;
};

InterceptMethods::InterceptMethods(MethodInterceptor interceptor) {
  if (!interceptor) throw ValueError("InterceptMethods: the interceptor is empty; pass a callable");
  hook_ = std::make_unique<Hook>(std::move(interceptor));
  guard_ = std::make_unique<detail::ModuleCallHookGuard>(hook_.get());
}

InterceptMethods::~InterceptMethods() { guard_.reset(); }

}  // namespace linum
