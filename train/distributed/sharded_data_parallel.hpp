// Sharded data parallelism (DeepSpeed's ZeRO stages, PyTorch FSDP's SHARD_GRAD_OP): each rank keeps
// the optimizer state -- and from stage 2 the gradients -- of its own slice of every parameter.
//
//   dist::ShardedDataParallel trainer(params, optim::adamw(1e-3), {.stage = 2, .data = {.micro_batches = 8}});
//   for (...) {
//     auto step = trainer.step(loss, batch, key);     // loss(params, batch piece, key), as DataParallel's
//     ...
//   }
//   Tree params = trainer.params();                   // the whole parameters, the same on every rank
//   trainer.save("ckpt/step_100");                    // every rank writes its slices
//
// Stages (what each rank holds between steps; P ranks, n parameters):
//  0  everything whole: plain data parallelism with the optimizer on every rank (for comparison);
//  1  the optimizer state of its slices only (adam: 8n/P bytes instead of 8n); the whole gradient
//     is summed on every rank as DataParallel does, each rank updates its slices, and the updated
//     slices are gathered (one allgather of n parameters);
//  2  as 1, and the gradients are reduce-scattered: each parameter enters the loss through one op
//     whose backward sends its gradient, as soon as autodiff completes it, cut by destination to
//     the owners of its slices (reproducible mode: MPI_Alltoallv, and micro-batches are folded as
//     at stage 3 below; fast mode: MPI_Reduce_scatter), so no rank holds a summed whole gradient.
//  3  as 2, and the parameters too: between steps a rank holds only its slices; a parameter is
//     gathered (one allgather) when a module reads it (Scope::param, through a param-read hook),
//     released after the module's ops used it (the ops' saved inputs become handles, and backward
//     gathers again; remat's recomputation gathers again too), and its gradient is sent to the
//     owners of its slices as soon as backward has it. Ranks take micro-batches round-robin (piece
//     m on rank m % P), so each round's pieces arrive in order and the owner adds them into the
//     fixed tree left to right, keeping one partial sum per tree level: no rank ever holds a whole
//     gradient or all parameters. The same bits as stages 0-2. A parameter read several times in
//     a micro-batch (tied weights, e.g. an embedding also used as the output layer) is gathered
//     per read; its reads' cotangents are added on the rank as they arrive, as autodiff adds a
//     leaf's, and the sum goes out with the last: the bits of one process when each read's uses
//     are not interleaved with another read's (a shared module, an embedding's lookup and
//     attend), else within float rounding of them. Needs the loss to pass its params tree
//     unchanged as apply's "params" collection and the same control flow on every micro-batch.
//  Stages 2 and 3 take micro-batches round-robin: ceil(M / P) rounds, and a rank with no piece
//  left in the last round runs a stand-in (a copy of the last piece, its values dropped) so that
//  every rank makes the same collective calls. With options.data.overlap (the default) they
//  overlap communication with compute (MPI's nonblocking collectives, on the calling thread):
//  gradient slices are sent without waiting (at most two parameters' exchanges under way), and
//  stage 3 records the order in which a micro-batch gathers parameters (forward reads, remat's
//  recomputations, backward's regathers) and, whenever it gathers one, starts the gather of the
//  next in that order (FSDP's forward and backward prefetch: one parameter ahead). The bits do
//  not change. A rank that fails while collectives are under way aborts the job
//  (dist::abort_job), as DataParallel's overlap does. Communication buffers are Linum arrays:
//  memory(), live limits and the remat planner count them.
//
// Remat under a per-rank budget: plan_remat() runs lift::plan_remat on the step's forward and
// backward passes (gathers, gradient exchange and the rank's slices and optimizer state included
// in the live bytes it measures) on every rank together, each figure the maximum over the ranks,
// so every rank gets the same plan; apply it around step() with lift::PlanScope.
//
// Which slice: dist::ShardLayout (sharding.hpp) cuts every parameter along one axis, chosen by the
// logical axis names the init dict carries (nn::with_partitioning) and ShardingRules.
//
// Reproducible for any rank count: in Reduction::reproducible the summed gradient slices are the
// bits of DataParallel's fixed tree, elementwise optimizer steps do not depend on where a slice
// starts, and norms (clip_by_global_norm, lamb's trust ratio, adafactor's block rms) are exact sums
// merged across ranks (optim::SquareSum): every stage on 1, 2 or 3 ranks ends with bitwise the
// parameters one process computes with DataParallel and the same optimizer. Reduction::fast sums in
// the order the ranks give (within float rounding of it).
//
// Optimizers must not need a parameter's whole shape: adafactor's factored moments and per-example
// (DP-SGD) aggregation throw a ValueError on shards (use stage 0 for them); optim::masked's masks see
// slices, so they must select by path, not by shape. Every rank must build the same layout: pass
// each rank the init dict with its axis names (dist::broadcast and files do not carry them; give
// ShardingRules-free trees or init on every rank with the same key) -- a mismatch is a DistError.
// An optimizer step that throws leaves the trainer unusable until restore().
#pragma once

#include <linum/lift/plan.hpp>
#include <linum/train/distributed/data_parallel.hpp>
#include <linum/train/distributed/sharding.hpp>
#include <linum/train/optim.hpp>

#include <filesystem>
#include <memory>

namespace linum::dist {

struct ShardedDataParallelOptions {
  int stage = 2;                  // 0, 1, 2 or 3 (see above)
  DataParallelOptions data;       // reduction, micro-batches, communicator, aux sync, ...
  ShardingRules rules;            // which axis of each parameter is cut
};

// Bytes this rank holds, by kind.
struct RankBytes {
  std::int64_t params = 0;           // parameters kept between steps: whole ones (stages 0-2) and this rank's slices
  std::int64_t gradients = 0;        // the gradient buffers of the last step (whole or slices, and partial sums)
  std::int64_t optimizer_state = 0;  // this rank's optimizer state
  std::int64_t activations = 0;      // the peak of Linum's live array bytes during the last step's compute
  std::int64_t state() const { return params + gradients + optimizer_state; }
};

struct ShardedStepResult {
  Array loss;        // mean loss over the global batch (every rank)
  Tree aux;          // as DataParallel's (Sync); Sync::per_rank at stages 2-3: the mean over the rows of
                     // this rank's own micro-batches (round-robin, not DataParallel's contiguous block)
  StepStats stats;   // the gradient exchange (and, in wire_bytes, the parameter gather)
  double optimizer_s = 0;   // the optimizer's update of this rank's slices
  double gather_s = 0;      // the allgather of updated slices
  int prefetched_gathers = 0;  // stage 3 with overlap: parameter gathers started before the read that used them
                               // (stats.exposed_s: the time spent waiting for gathers and exchanges)
};

class ShardedDataParallel {
 public:
  // `params`: the whole initial parameters, the same on every rank (checked), float32 or bfloat16,
  // axis names (Tree::axis_names) read for the layout. The optimizer state is built for this rank's
  // slices.
  ShardedDataParallel(const Tree& params, optim::GradientTransformation optimizer, ShardedDataParallelOptions options = {});
  ~ShardedDataParallel();
  ShardedDataParallel(ShardedDataParallel&&) noexcept;
  ShardedDataParallel& operator=(ShardedDataParallel&&) noexcept;

  // One training step on the global `batch` (every rank passes all of it and the same key):
  // gradients as DataParallel::value_and_grad, then the optimizer on this rank's slices.
  ShardedStepResult step(const LossWithAux& loss, const Tree& batch, rng::Key key);
  ShardedStepResult step(const Loss& loss, const Tree& batch, rng::Key key);

  // A remat plan for step(loss, batch, key) whose forward and backward passes keep the peak of
  // live bytes within `budget_bytes` on every rank (the smallest budget any rank gives; the rank's
  // parameter slices, optimizer state, gathered parameters and gradient buffers count: they are
  // live), the same plan on every rank (lift::plan_remat profiling the step's gradient computation
  // without an update; options.agree is set here). Run steps under lift::PlanScope(plan). A
  // collective call; a ValueError on every rank when no plan fits.
  lift::RematPlan plan_remat(const LossWithAux& loss, const Tree& batch, rng::Key key, std::int64_t budget_bytes,
                             lift::PlanOptions options = {});
  lift::RematPlan plan_remat(const Loss& loss, const Tree& batch, rng::Key key, std::int64_t budget_bytes,
                             lift::PlanOptions options = {});

  // The whole parameters (every rank holds them in stages 0-2; stage 3 gathers them: a collective call).
  Tree params() const;
  // This rank's slices of the parameters and its optimizer state.
  const Tree& local_params() const;
  const Tree& local_optimizer_state() const;
  // The whole optimizer state, as optimizer.init(params) lays it out (a collective call).
  Tree optimizer_state() const;

  const ShardLayout& layout() const;
  int stage() const;
  // What this rank holds now (gradients and activations: during the last step).
  RankBytes memory() const;

  // Writes this rank's slices and optimizer state to dir/shard-<rank>-of-<P>.msgpack and, from
  // rank 0, the layout to dir/layout.json (each file written atomically; a collective call).
  void save(const std::filesystem::path& dir) const;
  // Reads a directory written by save() on any number of ranks (the layout is checked against this
  // trainer's parameters: same paths, shapes, dtypes and axes); with another rank count, each rank
  // rebuilds its slices from the saved ones. A collective call.
  void restore(const std::filesystem::path& dir);

 private:
  void restore_local(const std::filesystem::path& dir);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace linum::dist
