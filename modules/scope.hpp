// Scope: a module's view of its variable collections and PRNG streams.
//
// A module is a plain struct whose fields are hyperparameters and whose `operator()` takes a
// Scope& plus inputs (the counterpart of Flax's @nn.compact __call__):
//
//   struct MLP {
//     int features = 128;
//     Array operator()(Scope& s, Array x) const {
//       x = gelu(s(nn::Dense{.features = features}, x));   // child "Dense_0"
//       return s("head", nn::Dense{.features = 10}, x);     // child "head"
//     }
//   };
//
// Inside a module, `param` creates a parameter at init and reads it at apply, `variable` does the
// same for any collection (e.g. "batch_stats"), `make_rng` draws a key from a named stream
// (derived from the stream's key, the module path and a per-scope counter exactly as in Flax), and
// calling `s(module, args...)` runs a child module in a child scope. Children are auto-named per
// type (`Dense_0`, `Dense_1`, ...) or named explicitly; calling the same name again shares its
// variables.
#pragma once

#include <linum/core/array.hpp>
#include <linum/core/autodiff/flat_call.hpp>
#include <linum/core/context.hpp>
#include <linum/core/autodiff/pytree.hpp>
#include <linum/core/debug_nans.hpp>
#include <linum/core/error.hpp>
#include <linum/core/memory.hpp>
#include <linum/core/tree.hpp>
#include <linum/rng/key.hpp>
#include <linum/rng/streams.hpp>

#include <concepts>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <tuple>
#include <set>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace linum {

namespace lift::detail {
class Pack;
}

// Creates a parameter's initial value from a key and a shape (see modules/initializers.hpp).
using Initializer = std::function<Array(rng::Key key, const Shape& shape)>;

class Scope;
class Variable;

namespace detail {

// Axis names for the param an initializer is creating (nn::with_partitioning calls it from inside
// the initializer; Scope::param attaches them to the new leaf, Tree::axis_names).
void set_pending_param_axis_names(std::vector<std::string> names);

// How many keys a module at `path` drew from `stream` so far (Scope::make_rng's counter).
struct RngCounterKey {
  std::string stream;
  std::string path;  // the module path, joined ("" for the root)
  auto operator<=>(const RngCounterKey&) const = default;
};

// How many keys each (stream, module path) drew so far.
using RngCounters = std::map<RngCounterKey, std::uint64_t>;

struct ModuleEntry;

// The variable and PRNG state shared by every scope of one init or apply call. Sealed: modules see
// it only through Scope (and Variable); the module entry points (init/apply, detail::ModuleEntry)
// create and read it, and the lifting engine (lift::detail::Pack) is the only code that selects,
// lifts and publishes it.
class ScopeState {
 public:
  ScopeState() = default;

 private:
  friend class linum::Scope;
  friend class linum::Variable;
  friend struct ModuleEntry;
  friend class linum::lift::detail::Pack;

  bool is_mutable(std::string_view collection) const {
    return (all_mutable || mutable_collections.count(collection) > 0) && read_only.count(collection) == 0;
  }
  // Throws ValueError if `collection` is not visible here (not lifted into a transform).
  void check_collection_visible(std::string_view collection, std::string_view module_path) const;

  bool initializing = false;
  Tree variables;                                      // every collection, e.g. {"params": ..., "batch_stats": ...}
  bool all_mutable = false;                            // init: every collection may be written
  std::set<std::string, std::less<>> mutable_collections;
  std::map<std::string, std::string, std::less<>> read_only;  // never mutable here -> what a write's error says
  rng::Streams rngs;
  RngCounters rng_counters;                            // draws so far per (stream, module path)
  std::set<std::string, std::less<>> touched;          // full variable paths read or written
  bool defer_missing_params = false;                   // apply's root state: collect missing params, report at the end
  // Those params in call order: (full path, how the error lists it: the first with the whole
  // explanation, the others as "params/a/w (3,)").
  std::vector<std::pair<std::string, std::string>> missing_params;
  Tree created;                                        // variables created here, at their initial values
  // Inside a lifted transform (lift::remat, lift::scan): the collections and streams it lifts
  // (unset: all), and a description of the transform for error messages.
  std::optional<std::set<std::string, std::less<>>> lifted_collections;
  std::optional<std::set<std::string, std::less<>>> lifted_streams;
  std::string lift_note;
};

// "Encoder_0/Dense_1" for {"Encoder_0", "Dense_1"}; "" for the root.
std::string join_module_path(const std::vector<std::string>& parts);

// "Dense" for linum::nn::Dense, "Block" for Block<3>; or M::module_name when declared.
std::string demangled_type_name(const char* mangled);

// The path of the module whose body is running on this thread (null outside modules). Checkpoint
// policies and residual reports use it.
const std::vector<std::string>* current_module_path();

// ---- module-call hooks (Flax's intercept_methods) ---------------------------------------------
// Every module call goes through the hooks installed on its thread that want it: lift::RematScope
// and lift::PlanScope take child calls over (lift/remat_rule.hpp), nn::tabulate records them.

// One module call as hooks see it.
struct ModuleCall {
  enum class Kind {
    child,   // s(module, ...) or s("name", module, ...)
    method,  // s.call(&M::method, module, ...)
    entry,   // the root module of init/apply, a lift::scan iteration's body
  };
  const std::vector<std::string>& path;
  const std::string& type;
  Kind kind;
  // The call's arguments as `body` (see ModuleCallHook::around) holds them: a checkpoint may keep
  // their arrays elsewhere until it recomputes (null in wants()).
  std::shared_ptr<pytree::StoredArguments> arguments = nullptr;
};

// Runs (the rest of) a module call on a scope; returns the output's arrays.
using ModuleCallBody = std::function<std::vector<Array>(Scope&)>;

class ModuleCallHook {
 public:
  virtual ~ModuleCallHook() = default;
  // Whether the hook takes part in `call` (asked once per call; a call no hook wants runs directly).
  virtual bool wants(const ModuleCall& call) const = 0;
  // Runs the call. `next(scope)` continues it (the hooks installed inside this one, then the module)
  // and is valid during this call only. `body(scope)` runs the module alone on copies of the module
  // and the arguments, so a hook may keep it for child calls (a checkpoint's recomputation runs it
  // after the call returned, when the hooks inside may be gone).
  virtual std::vector<Array> around(Scope& scope, const ModuleCall& call, const ModuleCallBody& next,
                                    const ModuleCallBody& body) = 0;
};
struct ModuleCallHookContext { using Value = ModuleCallHook*; };

// Installs a hook for its lifetime (core/context.hpp). Hooks installed earlier wrap those installed
// later: the outermost runs first and its `next` reaches the inner ones.
class ModuleCallHookGuard {
 public:
  explicit ModuleCallHookGuard(ModuleCallHook* hook) : installed_(hook) {}

 private:
  ContextStack<ModuleCallHookContext>::Entry installed_;
};

// The hooks of this thread that want `call`, outermost first.
std::vector<ModuleCallHook*> hooks_for(const ModuleCall& call);
// Runs `call` through `hooks` (outermost first), ending in `body`.
std::vector<Array> run_hooks(Scope& scope, const ModuleCall& call, const std::vector<ModuleCallHook*>& hooks,
                             const ModuleCallBody& body);

// ---- param-read hooks (Flax's nn.map_variables on the way in) -----------------------------------
// While installed, every Scope::param that finds its param in the variable dict hands it to the
// hook first: `read(full_path, stored, wanted_shape)` returns the array the module gets instead
// (of shape `wanted`), or nothing to keep the stored one. dist::ShardedDataParallel's stage 3 keeps
// slices in the dict and gathers each whole parameter here, when its module reads it.
class ParamReadHook {
 public:
  virtual ~ParamReadHook() = default;
  virtual std::optional<Array> read(const std::string& full_path, const Array& stored, const Shape& wanted) = 0;
};
struct ParamReadHookContext { using Value = ParamReadHook*; };
class ParamReadHookGuard {
 public:
  explicit ParamReadHookGuard(ParamReadHook* hook) : installed_(hook) {}

 private:
  ContextStack<ParamReadHookContext>::Entry installed_;
};

struct ModulePathContext { using Value = const std::vector<std::string>*; };
// Sets the current module path for its lifetime.
class ModulePathGuard {
 public:
  explicit ModulePathGuard(const std::vector<std::string>* path) : set_(path) {}

 private:
  ContextStack<ModulePathContext>::Entry set_;
};

}  // namespace detail

// The name used to auto-name a module type's instances (Flax: the class name). Declare
// `static constexpr std::string_view module_name = "...";` in a module to choose it.
template <class M>
std::string module_type_name() {
  if constexpr (requires { { M::type_name() } -> std::convertible_to<std::string>; }) return M::type_name();
  else if constexpr (requires { typename M::lifted_module; }) return module_type_name<typename M::lifted_module>();
  else if constexpr (requires { M::module_name; }) return std::string(M::module_name);
  else return detail::demangled_type_name(typeid(M).name());
}

// A handle on one variable of a collection (Flax's `self.variable(...)`).
class Variable {
 public:
  Variable(detail::ScopeState* state, std::string collection, std::string path, std::string module_path)
      : state_(state), collection_(std::move(collection)), path_(std::move(path)), module_path_(std::move(module_path)) {}
  // The current value.
  const Array& value() const;
  // Replaces the value. Throws ValueError if the collection is not mutable in this apply call.
  void set(Array value) const;
  const std::string& collection() const { return collection_; }
  // Path inside the collection, e.g. "BatchNorm_0/mean".
  const std::string& path() const { return path_; }

 private:
  detail::ScopeState* state_;
  std::string collection_, path_, module_path_;
};

class Scope {
 public:
  Scope(detail::ScopeState& state, std::vector<std::string> path) : state_(&state), path_(std::move(path)) {}

  // ---- where we are ----------------------------------------------------------------------------
  const std::vector<std::string>& path() const { return path_; }
  // "Encoder_0/Dense_1", or "<root>" for the top-level module.
  std::string path_str() const;
  bool is_initializing() const { return state_->initializing; }
  bool is_mutable_collection(std::string_view collection) const { return state_->is_mutable(collection); }

  // ---- variables ---------------------------------------------------------------------------------
  // A parameter ("params" collection). At init it is created with init(make_rng("params"), shape);
  // at apply it is read and its shape checked against `shape`.
  Array param(std::string_view name, const Initializer& init, const Shape& shape);
  // A variable of any collection. `init` runs only when the variable does not exist yet and the
  // collection is mutable (always at init).
  Variable variable(std::string_view collection, std::string_view name, const std::function<Array()>& init);
  bool has_variable(std::string_view collection, std::string_view name) const;

  // ---- randomness --------------------------------------------------------------------------------
  // A fresh key from a named stream: fold_in(stream key, hash(path, count)) as in Flax, with a
  // per-scope, per-stream counter. Throws ValueError naming the stream and this module's path if
  // the stream was not given to init/apply.
  rng::Key make_rng(std::string_view stream);
  bool has_rng(std::string_view stream) const { return state_->rngs.has(stream); }

  // ---- intermediates -----------------------------------------------------------------------------
  // Stores `value` under <collection>/<path>/<name>/<i> (i = 0, 1, ... for repeated sows) when the
  // collection is mutable; otherwise does nothing and returns false (as Flax's sow).
  bool sow(std::string_view collection, std::string_view name, const Array& value);
  // Flax's sow with reduce_fn and init_fn: the value stored at <collection>/<path>/<name> (no
  // index) becomes reduce(previous, value), the previous being init() at the first sow. A running
  // sum of auxiliary losses:
  //   s.sow("losses", "aux", l, [](const Array& acc, const Array& x) { return acc + x; },
  //         [] { return Array::zeros(Shape{}); });
  bool sow(std::string_view collection, std::string_view name, const Array& value,
           const std::function<Array(const Array& previous, const Array& value)>& reduce, const std::function<Array()>& init);
  // The same for a value of several arrays (a module's tuple output): <name>/<i>/0, <name>/<i>/1, ...
  bool sow(std::string_view collection, std::string_view name, const std::vector<Array>& values);
  // Flax's perturb: `value` plus a variable <collection>/<path>/<name> of zeros, so that the
  // gradient with respect to that collection is the gradient with respect to this intermediate
  // value (grad of a loss over {"params": p, "perturbations": z} at z = 0). The variable is created
  // where the collection is mutable (at init, which therefore returns "perturbations"); an apply
  // whose variables have no such collection gets `value` unchanged; one whose collection lacks this
  // entry, or holds one of another shape, throws ValueError / ShapeError.
  Array perturb(std::string_view name, const Array& value, std::string_view collection = "perturbations");

  // ---- child modules -----------------------------------------------------------------------------
  // Runs `module` in a child scope auto-named "<Type>_<n>".
  template <class M, class... Args>
    requires(!std::is_convertible_v<const M&, std::string_view> && std::invocable<const M&, Scope&, Args...>)
  decltype(auto) operator()(const M& module, Args&&... args) {
    return child_scope(next_auto_name(module_type_name<M>())).call_module(module, std::forward<Args>(args)...);
  }

  // Runs `module` in a child scope with an explicit name; the same name shares variables.
  template <class M, class... Args>
    requires std::invocable<const M&, Scope&, Args...>
  decltype(auto) operator()(std::string_view name, const M& module, Args&&... args) {
    return child_scope(std::string(name)).call_module(module, std::forward<Args>(args)...);
  }

  // A wrapper that leaves the layer it wraps bound to the calling module, as Flax binds a module to
  // the one that constructed it (nn::WeightNorm, nn::SpectralNorm): the layer's scope is a sibling
  // of the wrapper's, auto-named first ("Dense_1", then "WeightNorm_0"), and the wrapper runs as
  // module(own scope, layer scope, args...). Declared by `using layer_bound_to_caller = Layer;`.
  template <class M, class... Args>
    requires(!std::is_convertible_v<const M&, std::string_view> && requires { typename M::layer_bound_to_caller; })
  decltype(auto) operator()(const M& module, Args&&... args) {
    std::string layer_name = next_auto_name(module_type_name<typename M::layer_bound_to_caller>());
    return call_wrapper(next_auto_name(module_type_name<M>()), std::move(layer_name), module, std::forward<Args>(args)...);
  }
  template <class M, class... Args>
    requires requires { typename M::layer_bound_to_caller; }
  decltype(auto) operator()(std::string_view name, const M& module, Args&&... args) {
    std::string layer_name = next_auto_name(module_type_name<typename M::layer_bound_to_caller>());
    return call_wrapper(std::string(name), std::move(layer_name), module, std::forward<Args>(args)...);
  }

  // Calls another method of a module in an auto-named child scope: s.call(&Encoder::encode, enc, x).
  template <class M, class Method, class... Args>
    requires std::is_member_function_pointer_v<Method>
  decltype(auto) call(Method method, const M& module, Args&&... args) {
    Scope child = child_scope(next_auto_name(module_type_name<M>()));
    return child.enter(detail::ModuleCall::Kind::method, module,
                       [method](Scope& s, const M& m, auto&&... a) -> decltype(auto) {
                         return invoke_method(m, method, s, std::forward<decltype(a)>(a)...);
                       },
                       std::forward<Args>(args)...);
  }

  // Calls a method of a module in a named child scope: s.call("encoder", &Encoder::encode, enc, x).
  template <class M, class Method, class... Args>
    requires std::is_member_function_pointer_v<Method>
  decltype(auto) call(std::string_view name, Method method, const M& module, Args&&... args) {
    Scope child = child_scope(std::string(name));
    return child.enter(detail::ModuleCall::Kind::method, module,
                       [method](Scope& s, const M& m, auto&&... a) -> decltype(auto) {
                         return invoke_method(m, method, s, std::forward<decltype(a)>(a)...);
                       },
                       std::forward<Args>(args)...);
  }

 private:
  // ---- the machinery under the two verbs above (Scope's user API ends here) -------------------
  // Module entry points (init, apply, lift::scan's iterations) run bodies through
  // detail::ModuleEntry; lifted transforms reach the state through lift::detail::Pack.
  friend struct detail::ModuleEntry;
  friend class lift::detail::Pack;

  // Calls `method` of `module` in scope `s`; a lifted module (lift::remat) decides whether the
  // method runs checkpointed. (GCC 12's -Warray-bounds false positive on calls through a pointer
  // to member function of an empty module is silenced here, as in lift::remat::lifted_call.)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Warray-bounds"
#endif
  template <class M, class Method, class... Args>
  static decltype(auto) invoke_method(const M& module, Method method, Scope& s, Args&&... args) {
    if constexpr (requires { module.lifted_call(method, s, std::forward<Args>(args)...); })
      return module.lifted_call(method, s, std::forward<Args>(args)...);
    else
      return (module.*method)(s, std::forward<Args>(args)...);
  }
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

  // The child scope with this name.
  Scope child_scope(std::string name) const;
  // "Dense_0", "Dense_1", ...: the next auto-name for a type in this scope.
  std::string next_auto_name(const std::string& type_name);

  // Runs the wrapper `module` in child `own` with its layer's scope, child `layer`, beside it (built
  // from the scope the call runs in, so a hook that runs the call again elsewhere keeps the pair).
  template <class M, class... Args>
  decltype(auto) call_wrapper(std::string own, std::string layer, const M& module, Args&&... args) {
    return child_scope(std::move(own))
        .enter(detail::ModuleCall::Kind::child, module,
               [layer = std::move(layer)](Scope& s, const M& m, auto&&... a) -> decltype(auto) {
                 std::vector<std::string> beside = s.path_;
                 beside.back() = layer;
                 Scope layer_scope(*s.state_, std::move(beside));
                 return m(s, layer_scope, std::forward<decltype(a)>(a)...);
               },
               std::forward<Args>(args)...);
  }

  // Runs `module` as the body of this (child) scope; a memory timeline marks the call's return
  // (after a checkpointed call released its insides).
  template <class M, class... Args>
  decltype(auto) call_module(const M& module, Args&&... args) {
    struct ReturnMark {
      Scope* scope;
      ~ReturnMark() {
        if (memory::detail::timeline_recording()) scope->mark_timeline_return();
      }
    } mark{this};
    return enter(detail::ModuleCall::Kind::child, module,
                 [](Scope& s, const M& m, auto&&... a) -> decltype(auto) { return m(s, std::forward<decltype(a)>(a)...); },
                 std::forward<Args>(args)...);
  }

  // Runs `body(*this, args...)` as the body of `module` (the module entry points' way in:
  // detail::ModuleEntry::run).
  template <class M, class Body, class... Args>
  decltype(auto) run(const M& module, Body&& body, Args&&... args) {
    return enter(detail::ModuleCall::Kind::entry, module,
                 [&body](Scope& s, const M&, auto&&... a) -> decltype(auto) { return body(s, std::forward<decltype(a)>(a)...); },
                 std::forward<Args>(args)...);
  }

  // Every module call: through the module-call hooks that want it, else directly.
  // `body(scope, module, args...)` runs the module.
  template <class M, class Body, class... Args>
  decltype(auto) enter(detail::ModuleCall::Kind kind, const M& module, Body body, Args&&... args) {
    if (detail::ContextStack<detail::ModuleCallHookContext>::innermost() != nullptr) [[unlikely]] {
      const std::string type = module_type_name<M>();
      const detail::ModuleCall call{path_, type, kind};
      const std::vector<detail::ModuleCallHook*> hooks = detail::hooks_for(call);
      if (!hooks.empty()) return run_hooked(call, hooks, module, std::move(body), std::forward<Args>(args)...);
    }
    return run_body(module, body, std::forward<Args>(args)...);
  }

  template <class M, class Body, class... Args>
  auto run_hooked(const detail::ModuleCall& call, const std::vector<detail::ModuleCallHook*>& hooks, const M& module,
                  Body body, Args&&... args) -> std::decay_t<std::invoke_result_t<Body&, Scope&, const M&, Args...>> {
    using Out = std::decay_t<std::invoke_result_t<Body&, Scope&, const M&, Args...>>;
    const pytree::FlatCall<Out, std::decay_t<Args>...> flat(std::tuple<std::decay_t<Args>...>(std::forward<Args>(args)...));
    // The module alone, on copies of the module and the arguments (see ModuleCallHook::around).
    const detail::ModuleCallBody alone = flat.template body<Scope&>(
        [module, body](Scope& s, const auto&... a) -> Out { return s.run_body(module, body, a...); });
    detail::ModuleCall with_arguments = call;
    with_arguments.arguments = flat.arguments();
    return flat.rebuild(detail::run_hooks(*this, with_arguments, hooks, alone));
  }

  // The module's body in this scope: the module path set, outputs checked when debug checks are on,
  // Linum errors that escape annotated with this scope's path.
  template <class M, class Body, class... Args>
  decltype(auto) run_body(const M& module, const Body& body, Args&&... args) {
    detail::ModulePathGuard where(&path_);
    try {
      if (!linum::detail::debug_checks_on()) return body(*this, module, std::forward<Args>(args)...);
      decltype(auto) out = body(*this, module, std::forward<Args>(args)...);
      linum::detail::check_module_outputs(pytree::flatten(out));
      return out;
    } catch (const Error&) {
      rethrow_with_path(module_type_name<M>());
    }
  }

  detail::ScopeState& state() const { return *state_; }
  [[noreturn]] void rethrow_with_path(const std::string& type_name) const;
  void mark_timeline_return() const noexcept;
  std::string full_path(std::string_view name) const;  // "Dense_0/kernel"

  detail::ScopeState* state_;
  std::vector<std::string> path_;
  std::map<std::string, int, std::less<>> auto_name_counts_;
};

}  // namespace linum
