// Checkpoint policies: which values computed inside a checkpointed block may be kept for the
// backward pass instead of being recomputed (JAX's jax.checkpoint_policies, same names and rules).
//
// A policy sees every op the block records, as an OpInfo: the op kind, its output's shape and
// bytes and dtype, the name given by checkpoint_name (for those ops) and the path of the module
// that ran it.
// A saved value is reused when the block is recomputed; for matmul and conv2d the product is then
// not computed again.
//
//   lift::checkpoint(f, {.policy = policies::dots_saveable{}});
//   lift::checkpoint(f, {.policy = policies::save_only_these_names({"attn_out"})});
//   lift::checkpoint(f, {.policy = lift::Policy("big outputs", [](const lift::OpInfo& op) {
//                                     return op.bytes > (1 << 20); })});
#pragma once

#include <linum/core/array.hpp>
#include <linum/core/ops/kind.hpp>

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace linum::lift {

// What a policy knows about one recorded op.
struct OpInfo {
  std::string_view op;           // the op's name: ops::kind::matmul, ops::kind::conv2d, "gelu", ...
  const Shape& shape;            // output shape
  std::size_t bytes;             // output bytes
  std::string_view name;         // for checkpoint_name ops: the name; otherwise empty
  std::string_view module_path;  // "Encoder_0/Block_1", or empty outside modules
  DType dtype = DType::f32;      // output dtype (bytes count 2 per bf16 element)

  // A matrix product or convolution, the fused attention included: a dots policy saves its output
  // (ops::kind::is_dot).
  bool is_dot() const { return ops::kind::is_dot(op); }
  // A product with batch dimensions (ops::kind::has_batch_dims).
  bool has_batch_dims() const { return ops::kind::has_batch_dims(op); }
};

// A policy: a predicate over OpInfo plus a description. Default: nothing_saveable.
class Policy {
 public:
  using Predicate = std::function<bool(const OpInfo&)>;

  Policy();
  Policy(std::string description, Predicate saveable);
  // Any policy type below (e.g. policies::dots_saveable{}) converts to a Policy.
  template <class P>
    requires requires { { P::make() } -> std::same_as<Policy>; }
  Policy(P) : Policy(P::make()) {}  // NOLINT(google-explicit-constructor)

  bool saveable(const OpInfo& op) const { return predicate_ ? predicate_(op) : false; }
  // True for everything_saveable: the block is not recomputed at all (the same as no checkpoint).
  bool saves_everything() const { return everything_; }
  bool saves_nothing() const { return !predicate_ && !everything_; }
  const std::string& description() const { return description_; }

  static Policy everything();

 private:
  std::string description_;
  Predicate predicate_;
  bool everything_ = false;
};

}  // namespace linum::lift

// The policies, usable as values (`.policy = policies::dots_saveable{}`) and as template options
// (`lift::remat<Block, lift::policy<policies::dots_saveable>>`).
namespace linum::policies {

// Keep every value: no recomputation (the same as not checkpointing).
struct everything_saveable {
  static lift::Policy make();
};
// Keep nothing but the block's inputs (the default).
struct nothing_saveable {
  static lift::Policy make();
};
// Keep the outputs of matrix products and convolutions (matmul, batched matmul, conv2d).
struct dots_saveable {
  static lift::Policy make();
};
using checkpoint_dots = dots_saveable;
// Keep the outputs of matrix products without batch dimensions (not batched products, not
// convolutions), as JAX's dots_with_no_batch_dims_saveable.
struct dots_with_no_batch_dims_saveable {
  static lift::Policy make();
};
using checkpoint_dots_with_no_batch_dims = dots_with_no_batch_dims_saveable;

// Keep only values tagged with checkpoint_name(x, name) for one of `names`.
lift::Policy save_only_these_names(std::vector<std::string> names);
// Keep values tagged with checkpoint_name for any name except `names` (untagged values: never).
lift::Policy save_any_names_but_these(std::vector<std::string> names);
// Keep what either policy keeps.
lift::Policy save_from_both_policies(const lift::Policy& a, const lift::Policy& b);

// The policy a description names, for the policies above ("dots_saveable",
// "save_only_these_names(a, b)", ...): how plans and other saved settings store a policy. A policy
// made from a predicate of your own has no such name: ValueError.
lift::Policy from_description(std::string_view description);

}  // namespace linum::policies

namespace linum {

// Tags `x` with a name that policies can select (an identity op; gradients pass through).
Array checkpoint_name(const Array& x, std::string name);

}  // namespace linum
