// ResidualScope: while alive, the residuals of every op recorded on this thread are kept where a
// policy places them: PyTorch's save_on_cpu / saved_tensors_hooks, driven by Linum's policies.
//
//   {
//     lift::ResidualScope to_disk(policies::offload(policies::everything_saveable{}));
//     auto [loss, grads] = value_and_grad(loss_fn)(params);   // activations went to the spill file
//   }                                                          // and came back for the backward pass
//   lift::ResidualScope small(policies::compress(storage::Codec::int8, policies::everything_saveable{}));
//
// The policy sees each residual as the output of the op that computed it: OpInfo with that op's
// kind and checkpoint_name, the residual's shape, bytes and dtype, and the module path where it was
// saved. A residual the policy does not keep stays in RAM (outside a checkpoint nothing could
// recompute it), and so do constants and differentiation variables (parameters): they are alive
// anyway. An array several ops save is placed once (one copy in the spill file, or compressed,
// shared by those ops). Offloading is lossless (gradients bitwise those of the plain step); compression is not
// (error bounds in core/storage/compression.hpp). Inside the scope, checkpoints hand it what they
// keep too (their policy's RAM values); values recorded while a checkpoint recomputes its block in
// the backward pass are left in RAM: they live only until that block is differentiated.
#pragma once

#include <linum/core/autodiff/saved_hooks.hpp>
#include <linum/lift/policies.hpp>

namespace linum::lift {

class ResidualScope {
 public:
  explicit ResidualScope(Policy policy);
  const Policy& policy() const { return *policy_; }

 private:
  std::shared_ptr<const Policy> policy_;
  autodiff::SavedValueHooksGuard hooks_;
};

}  // namespace linum::lift
