// datasets::DataLoader: batches of a DataSource (an ArrayDataset in memory, a FileDataset on disk,
// or a user's own type: data_source.hpp) for training, as grain's DataLoader or PyTorch's
// DataLoader give them: shuffled per epoch with an explicit PRNG key, batched, sharded across
// processes, prepared ahead on background threads, and resumable from a saved position.
//
//   datasets::DataLoader loader(train, {.batch_size = 128, .seed = rng::key(0), .drop_remainder = true,
//                                   .num_epochs = 3});
//   for (const datasets::Batch& b : loader) {               // 3 epochs of 468 batches
//     step(b.data.at("image").array(), b.data.at("label").array());
//     if (b.last_in_epoch) save(..., loader.state_tree());   // resume: loader.restore(tree)
//   }
//
// Order: epoch e visits the records in jax.random.permutation(fold_in(seed, e), N) (the identity
// with shuffle = false), batch b takes positions [b B, (b + 1) B) of that order. It depends only on
// the seed, the epoch, the dataset size and the batch size, so a run resumed from a state, or run on
// another number of processes, sees exactly the same batches.
//
// Sharding: with shard_count P, shard i receives rows [i n / P, (i + 1) n / P) of every global batch
// of n rows (the rows dist::DataParallel's fast mode computes on rank i); the shards' batches put
// together are the single-process batch, whatever P is. (grain's ShardByJaxProcess splits the
// records instead, so each process sees other records when P changes.) ShardOptions::by_process()
// takes this process's rank and the job's size from linum::dist.
//
// Prefetching: with prefetch = k > 0, `workers` background threads keep up to k batches ready or in
// preparation (gathering rows and running `transform`, under NoGradGuard) while the caller trains;
// each worker prepares whole batches, and next() returns them in order whatever worker finished
// first, so the batches are the same for any number of workers. next() waits only when the workers
// are behind. More than one worker (PyTorch's num_workers, grain's worker_count) pays when gathering
// or the transform is slow: reading a FileDataset, decoding, augmenting. An exception thrown while
// preparing a batch is rethrown by the next() that would have returned it. prefetch = 0 prepares
// each batch inside next().
#pragma once

#include <linum/train/data/array_dataset.hpp>
#include <linum/train/data/data_source.hpp>
#include <linum/core/tree.hpp>
#include <linum/rng/key.hpp>

#include <cstdint>
#include <functional>
#include <iterator>
#include <memory>
#include <optional>
#include <vector>

namespace linum::datasets {

// This process's part of every global batch (see the file comment).
struct ShardOptions {
  int shard_index = 0;
  int shard_count = 1;
  // linum::dist's rank and job size (one shard when not under MPI).
  static ShardOptions by_process();
};

struct LoaderOptions {
  std::int64_t batch_size = 0;  // the global batch (required)
  bool shuffle = true;
  rng::Key seed{};  // the shuffle's key (rng::key(0) when left default)
  // Drop an epoch's last, partial batch (PyTorch's drop_last, grain's drop_remainder).
  bool drop_remainder = false;
  // Epochs to produce; 0: repeat forever.
  std::int64_t num_epochs = 1;
  ShardOptions shard{};
  // Batches prepared ahead (ready or in preparation) on background threads; 0: on the caller's
  // thread, inside next().
  int prefetch = 2;
  // Threads preparing batches when prefetch > 0 (at most prefetch of them have work at once).
  int workers = 1;
  // Applied to every batch (this shard's rows) before it is returned, on a worker thread:
  // augmentation, normalization, casts. Must not depend on call order (it may run ahead) and, with
  // workers > 1, may run on several threads at once.
  std::function<Tree(Tree batch, std::int64_t epoch, std::int64_t index)> transform{};
};

struct Batch {
  Tree data;                     // this shard's rows of the global batch, every column
  std::int64_t epoch = 0;        // 0-based
  std::int64_t index = 0;        // the batch's index within its epoch
  std::int64_t global_rows = 0;  // rows of the global batch (batch_size, or fewer for a last partial batch)
  std::int64_t first_row = 0;    // this shard's first row within the global batch
  bool last_in_epoch = false;
};

// Where a loader stands: the next batch it returns is batch `index` of epoch `epoch`.
struct LoaderPosition {
  std::int64_t epoch = 0;
  std::int64_t index = 0;
  friend bool operator==(const LoaderPosition&, const LoaderPosition&) = default;
};

class DataLoader {
 public:
  // ValueError for a batch size below 1, a bad shard, a negative epoch count or prefetch, fewer
  // than one worker (or several with prefetch = 0), or a dataset that makes no batch at all (fewer
  // records than one batch with drop_remainder).
  DataLoader(DataSource dataset, LoaderOptions options);
  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  // The next batch, or nullopt after the last epoch.
  std::optional<Batch> next();

  std::int64_t batches_per_epoch() const { return batches_per_epoch_; }
  const DataSource& dataset() const { return dataset_; }
  const LoaderOptions& options() const { return options_; }

  // The position of the next batch next() returns (batches already prepared ahead do not count).
  LoaderPosition position() const { return position_; }
  // Moves to `position` (prepared batches are discarded). ValueError past the last epoch.
  void seek(LoaderPosition position);

  // The position with what it depends on (dataset size, batch size, shuffle, seed,
  // drop_remainder) as a Tree of int32 scalars, to save in a checkpoint beside the model.
  Tree state_tree() const;
  // Seeks to a state_tree(); ValueError naming the field when it was saved for another dataset,
  // batch size, shuffle, seed or drop_remainder (the shard count may differ: positions count
  // global batches).
  void restore(const Tree& state);

  // Range-for over the remaining batches.
  class Iterator {
   public:
    using iterator_category = std::input_iterator_tag;
    using value_type = Batch;
    using difference_type = std::ptrdiff_t;
    using pointer = const Batch*;
    using reference = const Batch&;
    Iterator() = default;
    explicit Iterator(DataLoader* loader) : loader_(loader) { ++*this; }
    const Batch& operator*() const { return *current_; }
    const Batch* operator->() const { return &*current_; }
    Iterator& operator++() {
      current_ = loader_->next();
      if (!current_) loader_ = nullptr;
      return *this;
    }
    friend bool operator==(const Iterator& a, const Iterator& b) { return a.loader_ == b.loader_; }

   private:
    DataLoader* loader_ = nullptr;
    std::optional<Batch> current_;
  };
  Iterator begin() { return Iterator(this); }
  Iterator end() { return Iterator(); }

 private:
  struct Prefetcher;
  struct Orders;
  Batch make_batch(LoaderPosition at) const;
  bool finished(LoaderPosition at) const;
  LoaderPosition after(LoaderPosition at) const;
  // The position `steps` batches after `at`.
  LoaderPosition advance(LoaderPosition at, std::int64_t steps) const;
  void stop_prefetching();

  DataSource dataset_;
  LoaderOptions options_;
  std::int64_t batches_per_epoch_ = 0;
  LoaderPosition position_;
  std::unique_ptr<Prefetcher> prefetcher_;
  // The shuffled orders of the epochs being prepared, drawn by whichever thread needs one first.
  std::unique_ptr<Orders> orders_;
};

}  // namespace linum::datasets
