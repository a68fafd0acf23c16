// A checkpoint manager in the spirit of orbax.checkpoint.CheckpointManager: one directory per step
// under a root directory, written atomically, the last N and/or the best N by a metric kept,
// restore into a target tree whose structure, shapes and dtypes are checked.
//
//   CheckpointManager ckpt("runs/cnn", {.max_to_keep = 3, .best_metric = "accuracy", .best_mode = BestMode::max});
//   ckpt.save(step, Tree{{"params", params}, {"opt_state", opt_state}}, {{"accuracy", acc}});
//   if (auto last = ckpt.latest_step()) {
//     Tree restored = ckpt.restore(*last, Tree{{"params", params}, {"opt_state", opt_state}});
//   }
//
// With async_save, save() returns once the state is encoded in memory and the files are written on
// a background thread, as orbax's asynchronous checkpointing does:
//
//   CheckpointManager ckpt("runs/cnn", {.max_to_keep = 3, .async_save = true});
//   ckpt.save(step, state);        // the state as it is now; training goes on
//   ...
//   ckpt.wait_until_finished();    // the step is on disk (or its write error is thrown here)
//
// Layout: <root>/<step>/state.msgpack (Flax's msgpack layout) and <root>/<step>/metrics.json. A
// step is written into <root>/.tmp-<step>-<pid> and renamed into place only when complete (and
// fsynced), so a crash leaves either the whole step or none of it; temporaries a killed writer
// left are removed by the next manager on that root.
#pragma once

#include <linum/core/error.hpp>
#include <linum/core/tree.hpp>

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace linum {

enum class BestMode { min, max };

struct CheckpointManagerOptions {
  // Keep at most this many steps (0: keep all). Without best_metric: the newest; with it: the best
  // by that metric (steps saved without it rank last), plus always the newest step, so training
  // can resume.
  int max_to_keep = 0;
  std::string best_metric;
  BestMode best_mode = BestMode::max;
  // save() writes only steps that are multiples of this (orbax's save_interval_steps); 1: all.
  std::int64_t save_interval_steps = 1;
  // save() encodes the state (a copy: the caller may update the arrays at once) and returns; the
  // files are written, fsynced and renamed into place, and steps beyond max_to_keep removed, on a
  // background thread (orbax's enable_async_checkpointing). One save is in flight at a time: the
  // next save, every query (should_save excepted), restore and the destructor wait for it first. A
  // failed background write is thrown by the next call that waits, or by check_for_errors.
  bool async_save = false;
};

class CheckpointManager {
 public:
  // Creates `root` if needed; throws IoError if it is not a usable directory.
  explicit CheckpointManager(std::filesystem::path root, CheckpointManagerOptions options = {});
  // Waits for a save in flight; an error it ends with goes to warn() (a destructor cannot throw:
  // call wait_until_finished() first to handle it).
  ~CheckpointManager();
  CheckpointManager(CheckpointManager&&) noexcept;
  CheckpointManager& operator=(CheckpointManager&&) noexcept;
  CheckpointManager(const CheckpointManager&) = delete;
  CheckpointManager& operator=(const CheckpointManager&) = delete;

  // Whether save(step) would write (the interval, and the step not saved already nor in flight).
  bool should_save(std::int64_t step) const;
  // Writes the step (tree and metrics) atomically, then removes steps beyond max_to_keep (with
  // async_save: encodes them and leaves the writing to a background thread). Returns false when
  // should_save(step) is false. Throws ValueError for a negative step, one already saved or in
  // flight, or a metric that is not finite, before anything is written.
  bool save(std::int64_t step, const Tree& state, const std::map<std::string, double>& metrics = {});

  // Blocks until the save in flight (if any) is on disk; rethrows the error it ended with.
  void wait_until_finished() const;
  // Rethrows the error of a background save that has ended with one; never blocks.
  void check_for_errors() const;
  // The step a background save is writing, if one is in flight.
  std::optional<std::int64_t> step_in_flight() const;

  // Steps on disk, ascending.
  std::vector<std::int64_t> all_steps() const;
  std::optional<std::int64_t> latest_step() const;
  // The best step by best_metric (nullopt without a metric or a step that has it).
  std::optional<std::int64_t> best_step() const;
  // The metrics saved with a step.
  std::map<std::string, double> metrics(std::int64_t step) const;

  // The saved tree of `step`, checked against `target`: same keys, shapes and dtypes, else a
  // ValueError naming the first difference (a model or optimizer that changed since the save).
  Tree restore(std::int64_t step, const Tree& target) const;
  // The saved tree as it is, unchecked.
  Tree restore(std::int64_t step) const;

  const std::filesystem::path& directory() const { return root_; }

 private:
  struct InFlight;
  std::filesystem::path step_dir(std::int64_t step) const;
  std::filesystem::path root_;
  CheckpointManagerOptions options_;
  mutable std::unique_ptr<InFlight> in_flight_;  // the background save (queries wait for it)
};

}  // namespace linum
