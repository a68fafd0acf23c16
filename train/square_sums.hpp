// Sums of squares whose bits do not depend on the order of the terms, and the optimizer's view of
// leaves that are shards of larger parameters.
//
// An optimizer's norms (clip_by_global_norm, lamb's trust ratio, adafactor's block rms) add up
// x^2 over every element of a leaf or of a whole tree. Added in double in memory order, the result
// depends on that order: on how the leaf is cut among threads or among the ranks of a sharded job.
// SquareSum adds them exactly instead: every float32 x is m * 2^q with an integer m < 2^24, so x^2
// is the integer m^2 < 2^48 times a power of two; the integers are accumulated in 128-bit bins by
// exponent range, where nothing is rounded. Any split of the elements, merged in any order, gives
// the same bins, hence the same value: a norm is bitwise the same on one process and on any number
// of shards, and for any thread count.
//
//   optim::SquareSum s;
//   s.add(leaf);                 // float32 or bfloat16
//   double total = s.value();    // sum of squares, rounded once per bin
//
// When dist::ShardedDataParallel runs an optimizer on this rank's slices of the parameters, it
// installs a ShardReductions for the duration of the update: norms then combine their SquareSums
// with every other rank's (leaf_square_sums), and apply_if_finite agrees with the other ranks on
// whether the step was finite. Transformations that need a whole leaf (adafactor's factored
// moments, which look at a leaf's shape; per-example clipping) refuse to run on shards with a
// ValueError that says so.
#pragma once

#include <linum/core/array.hpp>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace linum::optim {

// (GCC and Clang's 128-bit integer; __extension__ keeps -Wpedantic quiet in users' builds.)
__extension__ typedef unsigned __int128 SquareSumBin;

// The exact sum of squares of float32 values.
class SquareSum {
 public:
  // The words to_words writes (bins, count, flags): what one SquareSum sends to another process.
  static constexpr int kWords = 2 * 16 + 2;

  // Adds x[i]^2 for every i (in any order: the result is exact).
  void add(const float* x, std::int64_t n);
  // Adds the squares of every element of a float32 or bfloat16 array (bf16 widened exactly).
  void add(const Array& leaf);
  // Adds another sum's terms.
  void merge(const SquareSum& other);

  // The sum: NaN if a NaN was added, +infinity if an infinity was, else each bin rounded to double
  // and the bins added from the largest (within a few ulps of the exact sum; a fixed function of
  // the bins, so the same bits for the same terms in any order).
  double value() const;
  // How many values were added.
  std::int64_t count() const { return count_; }

  // kWords words, and back (for sending a sum to other ranks).
  void to_words(std::uint64_t* out) const;
  static SquareSum from_words(const std::uint64_t* in);

 private:
  void add_serial(const float* x, std::int64_t n);
  std::array<SquareSumBin, 16> bins_{};
  std::int64_t count_ = 0;
  bool nan_ = false, inf_ = false;
};

// How an optimizer's reductions reach the rest of a parameter that this process holds a shard of.
class ShardReductions {
 public:
  virtual ~ShardReductions() = default;
  // Replaces each entry with its merge over every shard (every rank passes the same number of
  // entries, in the same order).
  virtual void merge_across_shards(std::vector<SquareSum>& sums) const = 0;
  // True when `value` is true on every shard.
  virtual bool all_across_shards(bool value) const = 0;
};

// Installs `reductions` for this thread while it lives (the previous one comes back after).
class ShardReductionsScope {
 public:
  explicit ShardReductionsScope(const ShardReductions* reductions);
  ~ShardReductionsScope();
  ShardReductionsScope(const ShardReductionsScope&) = delete;
  ShardReductionsScope& operator=(const ShardReductionsScope&) = delete;

 private:
  const ShardReductions* previous_;
};

// The ShardReductions installed on this thread, or nullptr (whole leaves).
const ShardReductions* active_shard_reductions();

// Each leaf's sum of squares, merged across shards when a ShardReductions is installed.
std::vector<SquareSum> leaf_square_sums(const std::vector<Array>& leaves);

// `value` on every shard (just `value` without a ShardReductions).
bool all_across_shards(bool value);

// Throws ValueError when a ShardReductions is installed: `who` needs whole leaves (`why`).
void require_whole_leaves(const std::string& who, const std::string& why);

}  // namespace linum::optim
