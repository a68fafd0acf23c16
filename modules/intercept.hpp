// Intercepting module calls (Flax's nn.intercept_methods): for the lifetime of an
// InterceptMethods, every module call on this thread (a child's operator(), Flax's __call__;
// another method through s.call; the root of init and apply) runs through an interceptor that sees
// where the call is, may read or replace its input arrays, runs it with next(), and returns its
// output arrays, changed or not.
//
//   // Log each Dense layer's output norm, and zero the output of "Block_2" (an ablation):
//   InterceptMethods spy([](MethodCall& call, const auto& next) {
//     std::vector<Array> out = next();
//     if (call.type() == "Dense") std::cout << call.path_str() << " " << norm(out[0]).item() << "\n";
//     if (call.path_str() == "Block_2") out[0] = zeros_like(out[0]);
//     return out;
//   });
//   Array y = apply(model, vars, x);
//
// Arrays are the call's inputs and outputs flattened as pytrees (an LSTM carry is two arrays).
// An interceptor must run the call (next(), once) and return as many arrays as it gave: the
// output's structure is the module's C++ type. Interceptors installed later run inside those
// installed earlier. Gradients flow through whatever the interceptor returns.
#pragma once

#include <linum/core/array.hpp>
#include <linum/modules/scope.hpp>

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace linum {

// One intercepted call.
class MethodCall {
 public:
  MethodCall(const detail::ModuleCall& call) : call_(call) {}  // NOLINT(google-explicit-constructor)
  // The module's path, {"Block_0", "Dense_1"} (empty for the root), and as "Block_0/Dense_1" ("" for the root).
  const std::vector<std::string>& path() const { return call_.path; }
  std::string path_str() const;
  // The module's type name, e.g. "Dense" (module_type_name).
  const std::string& type() const { return call_.type; }
  // True for operator() (and the root of init/apply), false for another method called with s.call.
  bool is_call() const { return call_.kind != detail::ModuleCall::Kind::method; }
  // The input arrays (flattened), before next() runs.
  std::vector<Array> arguments() const;
  // Replaces the input arrays before next() runs: as many as arguments() gave (ValueError otherwise).
  void set_arguments(std::span<const Array> arrays);

 private:
  const detail::ModuleCall& call_;
};

using MethodInterceptor = std::function<std::vector<Array>(MethodCall& call, const std::function<std::vector<Array>()>& next)>;

// Installs `interceptor` for this thread while it lives.
class InterceptMethods {
 public:
  explicit InterceptMethods(MethodInterceptor interceptor);
  ~InterceptMethods();
  InterceptMethods(const InterceptMethods&) = delete;
  InterceptMethods& operator=(const InterceptMethods&) = delete;

 private:
  struct Hook;
  std::unique_ptr<Hook> hook_;
  std::unique_ptr<detail::ModuleCallHookGuard> guard_;
};

}  // namespace linum
