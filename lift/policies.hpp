// Checkpoint policies: which values computed inside a checkpointed block may be kept for the
// backward pass instead of being recomputed (JAX's jax.checkpoint_policies, same names and rules).
//
// A policy sees every op the block records, as an OpInfo: the op kind, its output's shape and
// bytes and dtype, the name given by checkpoint_name (for those ops) and the path of the module
// that ran it.
// A saved value is reused when the block is recomputed; for matmul and conv2d the product is then
// not computed again.
//
// A policy also says where a value it keeps lives (storage::Placement): in RAM (the default), in
// the spill file (offload, lossless: gradients stay bitwise), compressed (bf16, int8 or fp8 with
// per-block scales: the backward pass reads a close copy, error bounds in core/storage/compression.hpp),
// or compressed in the spill file. The same policies decide for the residuals of a plain graph
// inside a lift::ResidualScope (lift/residual_scope.hpp).
//
//   lift::checkpoint(f, {.policy = policies::save_and_offload_only_these_names({"q"}, {"attn_out"})});
//   lift::checkpoint(f, {.policy = policies::offload(policies::dots_saveable{})});
//   lift::checkpoint(f, {.policy = policies::compress(storage::Codec::int8, policies::dots_saveable{})});
//
//   lift::checkpoint(f, {.policy = policies::dots_saveable{}});
//   lift::checkpoint(f, {.policy = policies::save_only_these_names({"attn_out"})});
//   lift::checkpoint(f, {.policy = lift::Policy("big outputs", [](const lift::OpInfo& op) {
//                                     return op.bytes > (1 << 20); })});
#pragma once

#include <linum/core/array.hpp>
#include <linum/core/ops/kind.hpp>
#include <linum/core/storage/stored_array.hpp>

#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
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

// A policy: a decision over OpInfo plus a description. Default: nothing_saveable.
class Policy {
 public:
  // Keep (in RAM) or recompute.
  using Predicate = std::function<bool(const OpInfo&)>;
  // Where to keep the value; nullopt: recompute it.
  using Decider = std::function<std::optional<storage::Placement>(const OpInfo&)>;

  Policy();
  Policy(std::string description, Predicate saveable);
  Policy(std::string description, Decider decide);
  // Any policy type below (e.g. policies::dots_saveable{}) converts to a Policy.
  template <class P>
    requires requires { { P::make() } -> std::same_as<Policy>; }
  Policy(P) : Policy(P::make()) {}  // NOLINT(google-explicit-constructor)

  std::optional<storage::Placement> decide(const OpInfo& op) const {
    return decider_ ? decider_(op) : std::nullopt;
  }
  bool saveable(const OpInfo& op) const { return decide(op).has_value(); }
  // True for everything_saveable: the block is not recomputed at all (the same as no checkpoint).
  bool saves_everything() const { return everything_; }
  bool saves_nothing() const { return !decider_ && !everything_; }
  // For policies::residuals(p): p (the call runs plainly, its residuals placed by p); else null.
  const Policy* residual_placement() const { return residual_placement_.get(); }
  // Whether some value may live beyond RAM as it is: offloaded or compressed (offload, compress,
  // save_and_offload_only_these_names, residuals, and what combines them). The planner charges such
  // policies the forward and backward time they add, not only their recomputation.
  bool places_beyond_ram() const { return beyond_ram_; }
  // Whether a checkpoint keeps its inputs in the spill file too (policies::offload): exact copies,
  // read back before the recomputation, so a checkpoint's RAM between its forward and backward
  // passes is only what the policy keeps in RAM.
  bool offloads_inputs() const { return inputs_on_disk_; }
  // For policies::split_batch(n, p): n, and p (what each slice runs under); else 1 and null.
  int batch_splits() const { return split_of_ ? splits_ : 1; }
  const Policy* split_policy() const { return split_of_.get(); }
  const std::string& description() const { return description_; }

  static Policy everything();

 private:
  std::string description_;
  Decider decider_;
  bool everything_ = false;
  bool beyond_ram_ = false;
  bool inputs_on_disk_ = false;
  std::shared_ptr<const Policy> residual_placement_;
  int splits_ = 1;
  std::shared_ptr<const Policy> split_of_;
  friend Policy policies_detail_beyond_ram(Policy p);
  friend Policy policies_detail_inputs_on_disk(Policy p, bool on_disk);
  friend Policy policies_detail_residuals(const Policy& placement);
  friend Policy policies_detail_split_batch(int n, const Policy& each);
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
// Keep what either policy keeps (where the first that keeps it says).
lift::Policy save_from_both_policies(const lift::Policy& a, const lift::Policy& b);

// JAX's save_and_offload_only_these_names: values tagged with a name of `saveable` are kept in RAM,
// those tagged with a name of `offloadable` go to the spill file; everything else is recomputed.
lift::Policy save_and_offload_only_these_names(std::vector<std::string> saveable, std::vector<std::string> offloadable);
// What `which` keeps goes to the spill file instead of RAM (with `which`'s codec), and so do a
// checkpoint's inputs (uncompressed: the recomputation starts from them, bit for bit).
// offload(nothing_saveable{}) recomputes everything and keeps only the inputs, on disk;
// offload(everything_saveable{}) recomputes nothing and keeps every value on disk.
lift::Policy offload(const lift::Policy& which);
// What `which` keeps is kept compressed with `codec` (where `which` keeps it).
lift::Policy compress(storage::Codec codec, const lift::Policy& which);
// Not a checkpoint: the call runs plainly (nothing is recomputed) and the residuals its ops record
// are kept where `placement` places them, as inside a lift::ResidualScope. Wherever a policy goes
// (checkpoint, remat, RematScope, PlanScope, the planner's candidates), this one offloads or
// compresses a call's residuals instead of recomputing them:
//   policies::residuals(policies::offload(policies::everything_saveable{}))
lift::Policy residuals(const lift::Policy& placement);
// The call runs on `n` consecutive slices of its batch (axis 0 of every array argument with the
// batch's rows), each slice a call under `each`, and its outputs are the slices' outputs joined
// along axis 0: the backward pass of each slice needs 1/n of the call's working set, which no
// placement lowers (an attention's q, k, v and their cotangents). Gradients equal the plain ones up
// to rounding (parameter gradients are summed over the slices). Only for calls whose ops treat each
// example alone (Dense, attention, LayerNorm, activations): a call that updates a collection other
// than params (BatchNorm's statistics) or draws random numbers (dropout) is a ValueError, as the
// slices' results would not be the whole batch's. Under lift::RematScope or lift::PlanScope (the
// planner's candidates). Elsewhere (checkpoint, remat<M>) it is a ValueError.
//   policies::split_batch(4, policies::residuals(policies::offload(policies::everything_saveable{})))
lift::Policy split_batch(int n, const lift::Policy& each);

// The policy a description names, for the policies above ("dots_saveable",
// "save_only_these_names(a, b)", "offload(compress(int8, dots_saveable))", ...): how plans and other
// saved settings store a policy. A policy made from a predicate of your own has no such name: ValueError.
lift::Policy from_description(std::string_view description);

}  // namespace linum::policies

namespace linum {

// Tags `x` with a name that policies can select (an identity op; gradients pass through).
Array checkpoint_name(const Array& x, std::string name);

}  // namespace linum
