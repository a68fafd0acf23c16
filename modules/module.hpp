// init and apply: running a module on explicit variables and PRNG streams.
//
//   auto vars = linum::init(MLP{}, rng::key(0), x);                    // {"params": {...}}
//   Array y = linum::apply(MLP{}, vars, x);
//   auto [y2, updates] = linum::apply(MLP{}, vars, {.rngs = {{"dropout", rng::key(1)}},
//                                                   .mutable_collections = {"batch_stats"}}, x, true);
//
// Both are pure: the same module, variables, keys and inputs give the same result, bit for bit.
#pragma once

#include <linum/core/autodiff/grad.hpp>
#include <linum/core/tree.hpp>
#include <linum/modules/scope.hpp>
#include <linum/rng/streams.hpp>

#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace linum {

// Options of an apply call.
struct ApplyOptions {
  rng::Streams rngs;                              // e.g. {{"dropout", rng::key(1)}}
  std::vector<std::string> mutable_collections;   // collections the call may write, e.g. {"batch_stats"}
  bool all_mutable = false;                       // every collection may be written (Flax's mutable=True)
  // Refuse variable dicts with "params" entries the model never read (usually a dict from another
  // model). Only checked when the module's operator() runs, not for other methods.
  bool check_unused = true;
  // Flax's capture_intermediates: the output of every module call (operator(), the root's too) is
  // sown into "intermediates" at the module's path as "__call__" (intermediates/Dense_0/__call__/0;
  // a module whose output has several arrays: .../__call__/0/0, .../__call__/0/1, ...), returned
  // with the other updates. `capture_filter`, when set, picks the calls: (module path as
  // "Block_0/Dense_1", "" for the root; type name such as "Dense") -> capture or not.
  bool capture_intermediates = false;
  std::function<bool(const std::string& path, const std::string& type)> capture_filter;
};

namespace detail {

// The module entry points' access to the state of a call (ScopeState is sealed; see scope.hpp).
struct ModuleEntry {
  // The state of an init call: every collection mutable, creating variables.
  static ScopeState for_init(const rng::Streams& rngs);
  // The state of an apply call on `variables` with `options`.
  static ScopeState for_apply(const Tree& variables, const ApplyOptions& options);
  static bool has_missing_params(const ScopeState& state) { return !state.missing_params.empty(); }
  // Throws the error for the params an apply found missing (has_missing_params).
  [[noreturn]] static void throw_missing_params(const ScopeState& state, const std::string& module_type);
  static void check_unused_params(const ScopeState& state, const std::string& module_type);
  // The mutable collections after a call (what apply returns next to the output).
  static Tree mutated_collections(const ScopeState& state);
  // The variables that init returns (every collection except "intermediates" unless asked for).
  static Tree initialized_variables(ScopeState& state, bool keep_intermediates);

  // The one internal way to run a module: body(s, args...) as `module`'s body in scope `s` (the
  // module path set, module-call hooks and debug checks told, Linum errors annotated with the
  // path). init/apply run the root module through it, lift::scan each iteration's body.
  template <class M, class Body, class... Args>
  static decltype(auto) run(Scope& s, const M& module, Body&& body, Args&&... args) {
    return s.run(module, std::forward<Body>(body), std::forward<Args>(args)...);
  }
  // Calls `method` of `module` in `s` (through a lifted module's lifted_call when it has one).
  template <class M, class Method, class... Args>
  static decltype(auto) invoke_method(const M& module, Method method, Scope& s, Args&&... args) {
    return Scope::invoke_method(module, method, s, std::forward<Args>(args)...);
  }
};

// apply's capture_intermediates: sows the output of each wanted module call into "intermediates".
class CaptureIntermediates final : public ModuleCallHook {
 public:
  explicit CaptureIntermediates(std::function<bool(const std::string&, const std::string&)> filter)
      : filter_(std::move(filter)) {}
  bool wants(const ModuleCall& call) const override;
  std::vector<Array> around(Scope& scope, const ModuleCall& call, const ModuleCallBody& next,
                            const ModuleCallBody& body) override;

 private:
  std::function<bool(const std::string&, const std::string&)> filter_;
};

// Installs CaptureIntermediates for an apply that asked for it (nothing otherwise).
class CaptureScope {
 public:
  explicit CaptureScope(const ApplyOptions& options);
  ~CaptureScope();
  CaptureScope(const CaptureScope&) = delete;
  CaptureScope& operator=(const CaptureScope&) = delete;

 private:
  std::unique_ptr<CaptureIntermediates> hook_;
  std::unique_ptr<ModuleCallHookGuard> guard_;
};

// Runs an apply; if params were missing, that is the error reported (also when a later op failed
// on the zeros standing in for them), listing every missing param and every unused entry.
template <class F>
auto run_apply(ScopeState& state, const std::string& module_type, F&& body) {
  auto run = [&] {
    try {
      return body();
    } catch (const std::exception&) {
      if (ModuleEntry::has_missing_params(state)) ModuleEntry::throw_missing_params(state, module_type);
      throw;
    }
  };
  auto out = run();
  if (ModuleEntry::has_missing_params(state)) ModuleEntry::throw_missing_params(state, module_type);
  return out;
}

// The one way into a module (init, init_method, apply, apply_method): runs body(root scope,
// args...) as `module`'s body on `state`, with Linum errors naming the module path and an apply's
// missing params reported together.
template <class M, class Body, class... Args>
auto run_module(const M& module, ScopeState& state, Body&& body, Args&&... args) {
  Scope root(state, {});
  return run_apply(state, module_type_name<M>(),
                   [&] { return ModuleEntry::run(root, module, std::forward<Body>(body), std::forward<Args>(args)...); });
}

// The body that calls `method` of the module (through a lifted module's lifted_call when it has one).
template <class M, class Method>
auto method_invoker(const M& module, Method method) {
  return [&module, method](Scope& s, auto&&... a) -> decltype(auto) {
    return ModuleEntry::invoke_method(module, method, s, std::forward<decltype(a)>(a)...);
  };
}

}  // namespace detail

// ---- init -------------------------------------------------------------------------------------

// Runs `module` in initialisation mode and returns (output, variables).
template <class M, class... Args>
auto init_with_output(const M& module, const rng::Streams& rngs, Args&&... args) {
  detail::ScopeState state = detail::ModuleEntry::for_init(rngs);
  auto out = detail::run_module(module, state, module, std::forward<Args>(args)...);
  return std::make_pair(std::move(out), detail::ModuleEntry::initialized_variables(state, false));
}

// Runs `module` in initialisation mode and returns its variables ({"params": ..., ...}).
// `rngs` is a set of named streams, or a single key for the "params" stream.
template <class M, class... Args>
Tree init(const M& module, const rng::Streams& rngs, Args&&... args) {
  return init_with_output(module, rngs, std::forward<Args>(args)...).second;
}
template <class M, class... Args>
Tree init(const M& module, rng::Key params_key, Args&&... args) {
  return init(module, rng::Streams(params_key), std::forward<Args>(args)...);
}

// Initialises through another method of the module: init_method(&Encoder::encode, enc, key, x).
template <class M, class Method, class... Args>
  requires std::is_member_function_pointer_v<Method>
Tree init_method(Method method, const M& module, const rng::Streams& rngs, Args&&... args) {
  detail::ScopeState state = detail::ModuleEntry::for_init(rngs);
  detail::run_module(module, state, detail::method_invoker(module, method), std::forward<Args>(args)...);
  return detail::ModuleEntry::initialized_variables(state, false);
}

// ---- apply ------------------------------------------------------------------------------------

namespace detail {
// True when a call's first argument is an ApplyOptions (the overload below that takes options).
template <class... Args>
inline constexpr bool options_first = false;
template <class First, class... Rest>
inline constexpr bool options_first<First, Rest...> = std::is_same_v<std::remove_cvref_t<First>, ApplyOptions>;
}  // namespace detail

// Runs `module` on `variables`; returns its output. Writing to any collection is an error.
// (Options first means the overload below; checked before invocability, so modules with a generic
// operator(), such as Sequential, are not instantiated with the options as an input.)
template <class M, class... Args>
  requires(!detail::options_first<Args...> && std::invocable<const M&, Scope&, Args...>)
auto apply(const M& module, const Tree& variables, Args&&... args) {
  detail::ScopeState state = detail::ModuleEntry::for_apply(variables, {});
  auto out = detail::run_module(module, state, module, std::forward<Args>(args)...);
  detail::ModuleEntry::check_unused_params(state, module_type_name<M>());
  return out;
}

// What apply with options returns: (output, updated mutable collections), a std::pair. When the
// call asked for no mutable collection it also converts to the output alone, as Flax's apply then
// returns just the output:
//   Array y = apply(model, vars, {.rngs = {{"dropout", key}}}, x);             // output only
//   auto [y, updates] = apply(model, vars, {.mutable_collections = {"batch_stats"}}, x);
// Taking the output alone from a call that asked for mutable collections throws ValueError (the
// updates would be lost).
template <class Out>
struct Applied : std::pair<Out, Tree> {
  Applied(Out output, Tree updates, bool mutable_requested)
      : std::pair<Out, Tree>(std::move(output), std::move(updates)), mutable_requested_(mutable_requested) {}
  operator Out() const& {  // NOLINT(google-explicit-constructor)
    check_output_only();
    return this->first;
  }
  operator Out() && {  // NOLINT(google-explicit-constructor)
    check_output_only();
    return std::move(this->first);
  }

 private:
  void check_output_only() const {
    if (mutable_requested_)
      throw ValueError("apply: this call asked for mutable collections, so it returns (output, updated collections); "
                       "take both, e.g. auto [y, updates] = apply(module, vars, options, x), or drop "
                       "mutable_collections/all_mutable from the options");
  }
  bool mutable_requested_;
};

// Runs `module` on `variables` with streams and mutable collections; returns (output, updated
// mutable collections), e.g. (logits, {"batch_stats": ...}); see Applied.
template <class M, class... Args>
  requires std::invocable<const M&, Scope&, Args...>
auto apply(const M& module, const Tree& variables, const ApplyOptions& options, Args&&... args) {
  detail::ScopeState state = detail::ModuleEntry::for_apply(variables, options);
  auto out = [&] {
    const detail::CaptureScope capture(options);
    return detail::run_module(module, state, module, std::forward<Args>(args)...);
  }();
  if (options.check_unused) detail::ModuleEntry::check_unused_params(state, module_type_name<M>());
  using Out = decltype(out);
  return Applied<Out>(std::move(out), detail::ModuleEntry::mutated_collections(state),
                      options.all_mutable || !options.mutable_collections.empty() || options.capture_intermediates);
}

// Runs another method of the module: apply_method(&Encoder::encode, enc, vars, options, x).
template <class M, class Method, class... Args>
  requires std::is_member_function_pointer_v<Method>
auto apply_method(Method method, const M& module, const Tree& variables, const ApplyOptions& options, Args&&... args) {
  detail::ScopeState state = detail::ModuleEntry::for_apply(variables, options);
  auto out = detail::run_module(module, state, detail::method_invoker(module, method), std::forward<Args>(args)...);
  using Out = decltype(out);
  return Applied<Out>(std::move(out), detail::ModuleEntry::mutated_collections(state),
                      options.all_mutable || !options.mutable_collections.empty());
}

}  // namespace linum

// Applied is a pair for structured bindings: auto [y, updates] = apply(...).
template <class Out>
struct std::tuple_size<linum::Applied<Out>> : std::integral_constant<std::size_t, 2> {};
template <std::size_t I, class Out>
struct std::tuple_element<I, linum::Applied<Out>> : std::tuple_element<I, std::pair<Out, linum::Tree>> {};
