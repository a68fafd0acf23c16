// lift::remat<Module, options...>: lifted rematerialization of modules (Flax's nn.remat).
//
//   using RematBlock = lift::remat<Block>;                                   // operator() checkpointed
//   using DotsBlock  = lift::remat<Block, lift::policy<policies::dots_saveable>>;
//   using Enc        = lift::remat<Encoder, lift::methods<&Encoder::encode, &Encoder::operator()>>;
//   x = s(RematBlock{{.features = 512}}, x, train);                          // same fields as Block
//   x = s(RematBlock{Block{.features = 512}}, x, train);                     // or from a Block value
//   x = s(lift::remat<Block>{{.features = 512}, policies::save_only_these_names({"h"})}, x, train);
//
// The wrapper has the fields of the module it wraps and keeps its name (remat<Dense> is still
// auto-named Dense_0), so variable dicts of remat and plain models are interchangeable.
//
// A checkpointed method runs on *lifted* state: the variable collections and PRNG streams it may
// use (all by default; choose with lift::variables<"params", ...> and lift::rngs<"dropout", ...>)
// become explicit inputs, and the mutable collections it writes come back as outputs, written to
// the enclosing scope once. When the backward pass recomputes the method, it sees the same
// variables (as they were on entry), draws the same keys (the rng counters are replayed, not
// advanced twice), and its writes are discarded: dropout masks are identical and batch statistics
// are updated exactly once. Gradients equal those of the plain model bit for bit.
//
// Options (any order, each at most once):
//   lift::methods<&M::f, ...>    methods to checkpoint (default: operator()); others run plainly.
//                                Methods reach the wrapper through Scope::call / apply_method.
//   lift::policy<P>              what may be saved instead of recomputed (policies.hpp). A policy
//                                value goes in the wrapper's `remat_policy` field instead.
//   lift::static_argnums<i, ...> array arguments that are not differentiated; 0 is the first
//                                argument after the Scope. Negative or out-of-range indices do not
//                                compile. (Non-array arguments are always static.)
//   lift::variables<"c", ...>    lifted collections (default: all).
//   lift::rngs<"s", ...>         lifted streams (default: all).
//   lift::verify                 check that recomputation reproduces the forward pass bit for bit.
//   lift::prevent_cse<b>         parity with jax.checkpoint; no effect in eager C++ (see
//                                CheckpointOptions). (Flax's `concrete` is gone, as in JAX.)
#pragma once

#include <linum/lift/checkpoint.hpp>
#include <linum/lift/pack.hpp>
#include <linum/lift/policies.hpp>
#include <linum/modules/scope.hpp>

#include <algorithm>
#include <concepts>
#include <functional>
#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace linum::lift {

// A string usable as a template argument: lift::variables<"params">.
template <std::size_t N>
struct fixed_string {
  char chars[N]{};
  constexpr fixed_string(const char (&s)[N]) {  // NOLINT(google-explicit-constructor)
    for (std::size_t i = 0; i < N; ++i) chars[i] = s[i];
  }
  constexpr std::string_view view() const { return {chars, N - 1}; }
};

template <auto... Methods>
struct methods {};
template <class P>
struct policy {};
template <int... Indices>
struct static_argnums {
  static_assert(((Indices >= 0) && ...),
                "lift::static_argnums: indices count from 0, the first argument after the Scope; negative "
                "indices are not accepted (Flax's self-relative counting is a common source of bugs)");
};
template <fixed_string... Names>
struct variables {
  static_assert(((Names.view().size() > 0) && ...), "lift::variables: collection names must not be empty");
};
template <fixed_string... Names>
struct rngs {
  static_assert(((Names.view().size() > 0) && ...), "lift::rngs: stream names must not be empty");
};
struct verify {};
template <bool B>
struct prevent_cse {};

namespace detail {

// ---- reading the options -------------------------------------------------------------------------
template <class T> struct is_methods : std::false_type {};
template <auto... M> struct is_methods<methods<M...>> : std::true_type {};
template <class T> struct is_policy : std::false_type {};
template <class P> struct is_policy<policy<P>> : std::true_type { using type = P; };
template <class T> struct is_static : std::false_type {};
template <int... I> struct is_static<static_argnums<I...>> : std::true_type {
  static std::vector<int> list() { return {I...}; }
  template <std::size_t N> static constexpr bool in_range() { return ((I < static_cast<int>(N)) && ...); }
};
template <class T> struct is_variables : std::false_type {};
template <fixed_string... N> struct is_variables<variables<N...>> : std::true_type {
  static std::vector<std::string> list() { return {std::string(N.view())...}; }
};
template <class T> struct is_rngs : std::false_type {};
template <fixed_string... N> struct is_rngs<rngs<N...>> : std::true_type {
  static std::vector<std::string> list() { return {std::string(N.view())...}; }
};

template <template <class> class Pred, class... Opts>
constexpr int count_matching() { return (0 + ... + (Pred<Opts>::value ? 1 : 0)); }

template <template <class> class Pred, class Default, class... Opts>
struct find_option { using type = Default; };
template <template <class> class Pred, class Default, class First, class... Rest>
struct find_option<Pred, Default, First, Rest...> {
  using type = std::conditional_t<Pred<First>::value, First, typename find_option<Pred, Default, Rest...>::type>;
};

template <class T>
struct is_known_option
    : std::bool_constant<is_methods<T>::value || is_policy<T>::value || is_static<T>::value || is_variables<T>::value ||
                         is_rngs<T>::value || std::is_same_v<T, verify> || std::is_same_v<T, prevent_cse<true>> ||
                         std::is_same_v<T, prevent_cse<false>>> {};

template <class A, class B>
constexpr bool same_member(A a, B b) {
  if constexpr (std::is_same_v<A, B>) return a == b;
  else return false;
}

template <class T> struct methods_list;
template <auto... M> struct methods_list<methods<M...>> {
  template <class Method>
  static constexpr bool contains(Method m) { return (same_member(M, m) || ...); }
};

template <class... Opts>
struct RematConfig {
  static_assert((is_known_option<Opts>::value && ...),
                "lift::remat: unknown option; use lift::methods<...>, lift::policy<P>, lift::static_argnums<...>, "
                "lift::variables<...>, lift::rngs<...>, lift::verify or lift::prevent_cse<b>");
  static_assert(count_matching<is_methods, Opts...>() <= 1, "lift::remat: give lift::methods at most once");
  static_assert(count_matching<is_policy, Opts...>() <= 1, "lift::remat: give lift::policy at most once");
  static_assert(count_matching<is_static, Opts...>() <= 1, "lift::remat: give lift::static_argnums at most once");
  static_assert(count_matching<is_variables, Opts...>() <= 1, "lift::remat: give lift::variables at most once");
  static_assert(count_matching<is_rngs, Opts...>() <= 1, "lift::remat: give lift::rngs at most once");

  using Methods = typename find_option<is_methods, void, Opts...>::type;
  using PolicyOpt = typename find_option<is_policy, policy<policies::nothing_saveable>, Opts...>::type;
  using Static = typename find_option<is_static, static_argnums<>, Opts...>::type;
  using Vars = typename find_option<is_variables, void, Opts...>::type;
  using Rngs = typename find_option<is_rngs, void, Opts...>::type;
  static constexpr bool kVerify = (std::is_same_v<Opts, verify> || ...);

  static CheckpointOptions options() {
    CheckpointOptions o;
    o.policy = Policy(typename is_policy<PolicyOpt>::type{});
    o.static_argnums = is_static<Static>::list();
    o.verify = kVerify;
    o.prevent_cse = !(std::is_same_v<Opts, prevent_cse<false>> || ...);
    return o;
  }
  static LiftFilters filters() {
    LiftFilters f;
    if constexpr (!std::is_void_v<Vars>) f.collections = is_variables<Vars>::list();
    if constexpr (!std::is_void_v<Rngs>) f.streams = is_rngs<Rngs>::list();
    return f;
  }
  // Is operator() checkpointed?
  template <class M>
  static constexpr bool lifts_call() {
    if constexpr (std::is_void_v<Methods>) return true;
    else if constexpr (requires { &M::operator(); }) return methods_list<Methods>::contains(&M::operator());
    else return false;
  }
  template <class Method>
  static bool lifts(Method m) {
    if constexpr (std::is_void_v<Methods>) return false;  // default: only operator()
    else return methods_list<Methods>::contains(m);
  }
};

// ---- the lifted call (remat.cpp) -----------------------------------------------------------------

using linum::detail::ScopeState;

// A checkpointed call's body: runs the module on the given (lifted) scope and returns its output's
// arrays. It runs once in the forward pass and again for each recomputation.
using ScopedBody = std::function<std::vector<Array>(Scope&)>;

// The engine behind remat<M> and RematScope: runs `body` on lifted state at scope `s` as a
// checkpointed block, publishes the mutable collections once, and returns the output arrays.
// `keep_plain(outputs)`, if given and true after the forward pass, keeps the block's graph instead
// (no checkpoint: RematScope's larger_than mode).
// `arguments`, if given, are the stored arguments `body` reads (a policy that offloads inputs
// takes their arrays to the spill file until the recomputation).
std::vector<Array> lifted_run(Scope& s, const ScopedBody& body, const CheckpointOptions& options,
                              const LiftFilters& filters, std::vector<Array> held,
                              const std::function<bool(const std::vector<Array>&)>& keep_plain = nullptr,
                              std::shared_ptr<pytree::StoredArguments> arguments = nullptr);
// The same with a separate body for the recomputations (`forward` runs once, during this call;
// `replay` is kept for the backward pass).
std::vector<Array> lifted_run(Scope& s, const ScopedBody& forward, ScopedBody replay, const CheckpointOptions& options,
                              const LiftFilters& filters, std::vector<Array> held,
                              const std::function<bool(const std::vector<Array>&)>& keep_plain = nullptr,
                              std::shared_ptr<pytree::StoredArguments> arguments = nullptr);

template <class Config, class M, class Body, class... Args>
auto lifted_invoke(const M& module, const std::optional<Policy>& policy, Scope& s, Body body, Args&&... args) {
  static_assert(is_static<typename Config::Static>::template in_range<sizeof...(Args)>(),
                "lift::static_argnums: an index is out of range for this call; count from 0 = the first argument "
                "after the Scope");
  CheckpointOptions options = Config::options();
  if (policy) options.policy = *policy;
  using Stored = std::tuple<std::decay_t<Args>...>;
  using Out = std::decay_t<std::invoke_result_t<Body&, const M&, Scope&, const std::decay_t<Args>&...>>;
  const pytree::FlatCall<Out, std::decay_t<Args>...> call(linum::lift::detail::make_static(
      Stored(std::forward<Args>(args)...), options.static_argnums, std::index_sequence_for<Args...>{}));
  ScopedBody scoped = call.template body<Scope&>([module, body](Scope& inner, const auto&... a) { return body(module, inner, a...); });
  return call.rebuild(lifted_run(s, scoped, options, Config::filters(), call.argument_arrays(), nullptr, call.arguments()));
}

}  // namespace detail

// The module `M` with the selected methods checkpointed (see the header comment).
template <class M, class... Options>
struct remat : M {
  using lifted_module = M;
  using config = detail::RematConfig<Options...>;

  // A policy given as a value (it overrides lift::policy<P>): policies that carry data, such as
  // save_only_these_names, need no wrapper type:
  //   s(lift::remat<Block>{{.features = 64}, policies::save_only_these_names({"x"})}, h)
  std::optional<Policy> remat_policy;

  template <class... Args>
    requires std::invocable<const M&, Scope&, Args...>
  auto operator()(Scope& s, Args&&... args) const {
    if constexpr (config::template lifts_call<M>())
      return detail::lifted_invoke<config>(static_cast<const M&>(*this), remat_policy, s,
                                           [](const M& m, Scope& inner, const auto&... a) { return m(inner, a...); },
                                           std::forward<Args>(args)...);
    else
      return M::operator()(s, std::forward<Args>(args)...);
  }

  // GCC 12 warns (-Warray-bounds) that a call through a pointer to member function of an empty
  // module reads past the object: the virtual-function branch of the call, never taken for these
  // non-virtual methods, loads a vtable pointer. A false positive; silenced for this function only.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Warray-bounds"
#endif
  // Called by Scope::call / apply_method for methods other than operator().
  template <class Method, class... Args>
  auto lifted_call(Method method, Scope& s, Args&&... args) const {
    const M& self = static_cast<const M&>(*this);
    using Out = std::decay_t<decltype((self.*method)(s, std::forward<Args>(args)...))>;
    if (config::lifts(method))
      return Out(detail::lifted_invoke<config>(self, remat_policy, s, [method](const M& m, Scope& inner, const auto&... a) {
        return (m.*method)(inner, a...);
      }, std::forward<Args>(args)...));
    return Out((self.*method)(s, std::forward<Args>(args)...));
  }
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
};

// remat<M, Options...> when `enabled`, M itself otherwise, for code that switches remat on and off
// with a template parameter. Both initialize from a module value, so one initializer serves both:
//   template <bool R> Array run(Scope& s, Array x) {
//     return s(lift::remat_if<R, Block>{Block{.features = 64}}, x);
//   }
template <bool enabled, class M, class... Options>
using remat_if = std::conditional_t<enabled, remat<M, Options...>, M>;

// Flax's other name for remat.
template <class M, class... Options>
using checkpoint = remat<M, Options...>;

}  // namespace linum::lift
