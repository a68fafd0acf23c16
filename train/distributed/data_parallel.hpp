// Data-parallel training: every rank holds the same variables, computes gradients on its part of
// the global batch, and all ranks end the step with the gradient of the whole batch.
//
//   dist::DataParallel dp({.micro_batches = 8});
//   auto loss = [&](const Tree& params, const Tree& batch, rng::Key key) {
//     auto [logits, updates] = apply(model, {{"params", params}, {"batch_stats", stats}},
//                                    {.rngs = {{"dropout", key}}, .mutable_collections = {"batch_stats"}},
//                                    batch.at("x").array(), true);
//     return std::make_pair(mean(cross_entropy(logits, batch.at("y").array())), updates);
//   };
//   auto step = dp.value_and_grad(loss, params, Tree{{"x", images}, {"y", labels}}, key);
//   // step.grads: the gradient of the global batch's mean loss, bitwise the same on every rank
//
// Every rank passes the whole global batch (rows it does not compute are not read) and the same
// key; remat inside the loss works exactly as on one process.
//
// Two ways to sum the ranks' gradients:
//
// * Reduction::reproducible (the default): the global batch is cut into `micro_batches` pieces
//   (piece m: rows [m*B/M, (m+1)*B/M)), ranks take consecutive pieces, each piece's gradient is
//   computed alone (with key fold_in(key, m)) and weighted by its share of the batch, and the pieces
//   are summed in one fixed pairwise tree over the piece index: sum(lo, hi) = sum(lo, mid) +
//   sum(mid, hi). Each rank sums the subtrees that lie within its pieces, the ranks exchange those
//   partial sums (one MPI_Allgatherv), and every rank completes the tree. The bits of the result
//   therefore depend only on the batch, M and the parameters -- not on how many ranks there are:
//   1, 2 or 3 processes train bitwise the same parameters (DDP, Horovod and pjit sum in an order
//   that depends on the rank count). The cost: each piece runs forward and backward on its own
//   (smaller matrix products; M = 1 is plain training), and ranks exchange partial sums, not a
//   reduced gradient: a rank whose pieces do not form one subtree sends two or three gradient-sized
//   blocks, and every rank receives every block (about P gradients instead of allreduce's 2).
//
// * Reduction::fast: each rank computes its rows [r*B/P, (r+1)*B/P) in one pass and the gradients
//   are summed by MPI_Allreduce in buckets of `bucket_bytes` (parameters in reverse order, as
//   PyTorch DDP does), each bucket sent from a communication thread as soon as the backward pass
//   has finished every gradient in it, while the rest of the backward pass runs. All ranks get the
//   same bits, but they change with the rank count (within float rounding).
//
// The loss's second result (aux: mutable collections such as BatchNorm statistics, or metrics) must
// be a tree of float32 arrays of the same shapes for every piece; it comes back as its mean over
// the global batch (Sync::average: "sync batch norm" for running statistics, the same on every
// rank) or over this rank's rows only (Sync::per_rank: each rank keeps its own statistics). Within
// the step, BatchNorm normalizes each piece with its own batch statistics.
#pragma once

#include <linum/core/array.hpp>
#include <linum/train/distributed/communicator.hpp>
#include <linum/core/tree.hpp>
#include <linum/rng/rng.hpp>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>

namespace linum::dist {

enum class Reduction { reproducible, fast };
enum class Sync { average, per_rank };

struct DataParallelOptions {
  Reduction reduction = Reduction::reproducible;
  // Reproducible mode: the number of pieces the global batch is cut into, the same for any rank
  // count (at least the number of ranks, at most the batch size).
  int micro_batches = 8;
  // Fast mode: the size of one allreduce message.
  std::int64_t bucket_bytes = 4 << 20;
  // Fast mode: send buckets from a communication thread during the backward pass (needs MPI with
  // MPI_THREAD_SERIALIZED); otherwise after it.
  bool overlap = true;
  // How the loss's aux tree is combined across ranks.
  Sync aux = Sync::average;
  Communicator comm;
};

// What one step cost this rank.
struct StepStats {
  int ranks = 1;
  int local_pieces = 0;           // micro-batches (reproducible) or 1 (fast) computed here
  std::int64_t local_rows = 0;    // batch rows computed here
  std::int64_t bytes_sent = 0;    // payload this rank handed to MPI
  std::int64_t wire_bytes = 0;    // estimate of the bytes this rank's network link carries out
  int messages = 0;               // collective calls
  double compute_s = 0;           // forward + backward (+ the local sums)
  double communication_s = 0;     // time spent in MPI calls, on whichever thread made them
  double exposed_s = 0;           // time the step waited for communication after its backward
  // The share of communication time that ran while backward computed (fast mode with overlap).
  double hidden_fraction() const {
    return communication_s > 0 ? std::max(0.0, 1.0 - exposed_s / communication_s) : 0.0;
  }
};

struct StepResult {
  Array loss;       // the mean loss over the global batch (every rank)
  Tree aux;         // see Sync
  Tree grads;       // gradient of `loss` with respect to params, bitwise the same on every rank
  StepStats stats;
};

// loss(params, batch piece, key) -> (mean loss over the piece, aux tree of float32 arrays).
using LossWithAux = std::function<std::pair<Array, Tree>(const Tree& params, const Tree& batch, rng::Key key)>;
// loss(params, batch piece, key) -> mean loss over the piece.
using Loss = std::function<Array(const Tree& params, const Tree& batch, rng::Key key)>;

class DataParallel {
 public:
  explicit DataParallel(DataParallelOptions options = {});
  ~DataParallel();
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  // One step's loss and gradient over the global `batch` (a tree whose leaves share their leading
  // dimension, the batch size), the same call on every rank.
  StepResult value_and_grad(const LossWithAux& loss, const Tree& params, const Tree& batch, rng::Key key);
  StepResult value_and_grad(const Loss& loss, const Tree& params, const Tree& batch, rng::Key key);

  // The rows [first, last) of a global batch of `batch_size` that this rank computes.
  std::pair<std::int64_t, std::int64_t> local_rows(std::int64_t batch_size) const;
  const DataParallelOptions& options() const { return options_; }

 private:
  struct Overlap;
  StepResult reproducible(const LossWithAux& loss, const Tree& params, const Tree& batch, rng::Key key, std::int64_t rows);
  StepResult fast(const LossWithAux& loss, const Tree& params, const Tree& batch, rng::Key key, std::int64_t rows);
  DataParallelOptions options_;
  std::unique_ptr<Overlap> overlap_;
};

}  // namespace linum::dist
