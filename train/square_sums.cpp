#include <linum/train/square_sums.hpp>
#include <linum/core/error.hpp>
#include <linum/core/ops/elementwise.hpp>
#include <linum/core/threading.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace linum::optim {

// x = m * 2^q with m < 2^24 (m = the fraction with its hidden bit; q = exponent - 150, or -149 for
// subnormals), so x^2 = m^2 * 2^(2q) with 2q + 298 in [0, 506]. Bin b holds the terms whose
// t = 2q + 298 lies in [32b, 32b + 32), each as m^2 << (t - 32b) < 2^78: a bin takes 2^50 terms
// before it could overflow.
void SquareSum::add_serial(const float* x, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) {
    std::uint32_t bits;
    std::memcpy(&bits, &x[i], sizeof bits);
    const std::uint32_t exponent = (bits >> 23) & 0xffu, fraction = bits & 0x7fffffu;
    if (exponent == 0xffu) {
      (fraction != 0 ? nan_ : inf_) = true;
      continue;
    }
    const std::uint64_t m = exponent == 0 ? fraction : (fraction | 0x800000u);
    const int t = 2 * (exponent == 0 ? 1 : static_cast<int>(exponent)) - 2;  // 2q + 298
    bins_[static_cast<std::size_t>(t >> 5)] += static_cast<SquareSumBin>(m * m) << (t & 31);
  }
  count_ += n;
}

void SquareSum::add(const float* x, std::int64_t n) {
  // Exact sums merge in any order: threads take any chunks, the bits stay those of one thread.
  constexpr std::int64_t kChunk = 1 << 16;
  if (n <= kChunk || linum::team_size() <= 1) {
    add_serial(x, n);
    return;
  }
  const std::int64_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<SquareSum> parts(static_cast<std::size_t>(chunks));
#pragma omp parallel for schedule(static) num_threads(linum::team_size())
  for (std::int64_t c = 0; c < chunks; ++c)
    parts[static_cast<std::size_t>(c)].add_serial(x + c * kChunk, std::min(kChunk, n - c * kChunk));
  for (const SquareSum& p : parts) merge(p);
}

void SquareSum::add(const Array& leaf) {
  if (leaf.dtype() == DType::f32) {
    add(leaf.data(), leaf.numel());
  } else if (leaf.dtype() == DType::bf16) {
    const Array wide = astype(leaf, DType::f32);  // exact
    add(wide.data(), wide.numel());
  } else {
    throw ValueError(detail::cat("optim::SquareSum: only float32 and bfloat16 leaves have norms, got ", leaf.type_str()));
  }
}

void SquareSum::merge(const SquareSum& other) {
  for (std::size_t b = 0; b < bins_.size(); ++b) bins_[b] += other.bins_[b];
  count_ += other.count_;
  nan_ = nan_ || other.nan_;
  inf_ = inf_ || other.inf_;
}

double SquareSum::value() const {
  if (nan_) return std::numeric_limits<double>::quiet_NaN();
  if (inf_) return std::numeric_limits<double>::infinity();
  double total = 0;
  for (std::size_t b = bins_.size(); b-- > 0;)
    total += std::ldexp(static_cast<double>(bins_[b]), 32 * static_cast<int>(b) - 298);
  return total;
}

void SquareSum::to_words(std::uint64_t* out) const {
  for (std::size_t b = 0; b < bins_.size(); ++b) {
    out[2 * b] = static_cast<std::uint64_t>(bins_[b]);
    out[2 * b + 1] = static_cast<std::uint64_t>(bins_[b] >> 64);
  }
  out[32] = static_cast<std::uint64_t>(count_);
  out[33] = (nan_ ? 1u : 0u) | (inf_ ? 2u : 0u);
}

SquareSum SquareSum::from_words(const std::uint64_t* in) {
  SquareSum s;
  for (std::size_t b = 0; b < s.bins_.size(); ++b)
    s.bins_[b] = (static_cast<SquareSumBin>(in[2 * b + 1]) << 64) | in[2 * b];
  s.count_ = static_cast<std::int64_t>(in[32]);
  s.nan_ = (in[33] & 1u) != 0;
  s.inf_ = (in[33] & 2u) != 0;
  return s;
}

namespace {
thread_local const ShardReductions* active = nullptr;
}

ShardReductionsScope::ShardReductionsScope(const ShardReductions* reductions) : previous_(active) { active = reductions; }
ShardReductionsScope::~ShardReductionsScope() { active = previous_; }

const ShardReductions* active_shard_reductions() { return active; }

std::vector<SquareSum> leaf_square_sums(const std::vector<Array>& leaves) {
  std::vector<SquareSum> sums(leaves.size());
  for (std::size_t i = 0; i < leaves.size(); ++i) sums[i].add(leaves[i]);
  if (active) active->merge_across_shards(sums);
  return sums;
}

bool all_across_shards(bool value) { return active ? active->all_across_shards(value) : value; }

void require_whole_leaves(const std::string& who, const std::string& why) {
  if (active)
    throw ValueError(detail::cat(who, ": cannot run on shards of the parameters (", why,
                                 "); use ShardedDataParallel's stage 0 for this optimizer, or another one"));
}

}  // namespace linum::optim
