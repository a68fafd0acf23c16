// Internal to the panel kernels (gemm_bf16_panels.cpp, gemm_f32_panels.cpp): what they share. The
// tile geometry; the fetches ahead (FetchAhead for the packings, next_tile_rows and fetch_evenly for
// the tiles); and how a product's tiles are dealt to the team (PanelSchedule, run_panel_product).
// The right operand's panels go in groups of about kGroupBytes (they stay in L2 while every row tile
// passes over them); within a group, row tiles go in items of kTilesPerItem, except at least the
// last kTailTiles, taken one at a time, so that the threads finish within about one tile of each
// other. With only items of four, one thread sat idle for up to an item at the end of each product:
// 25-45 us of a 1.1 ms bf16 product on the MLP shapes; measured with the deep MLP's bf16 step
// alternating in one process, the tail split made it 1.1-2.3% faster. The items run group by group,
// in a dynamic schedule.
#pragma once

#include <linum/core/fp_mode.hpp>
#include <linum/core/kernels/gemm.hpp>
#include <linum/core/threading.hpp>

#include <algorithm>
#include <cstdint>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace linum::kernels::detail {

// A tile of either kernel: kTileRows rows of the output by kPanelCols columns, one panel of the right
// operand wide (28 float32 accumulators + 2 panel registers + a broadcast of 32 zmm registers).
inline constexpr int kTileRows = 14;
inline constexpr std::int64_t kPanelCols = 32;

// The cache lines of `bytes` bytes from `from` on (none when bytes <= 0; from is then not read and
// may be null), fetched into L1 an equal share at each of `steps` calls of step(): the packings
// fetch the rows they will pack next while they pack these.
class FetchAhead {
 public:
  FetchAhead(const void* from, std::int64_t bytes, std::int64_t steps)
      : from_(static_cast<const char*>(from)),
        lines_(bytes > 0 ? (bytes + 63) / 64 : 0),
        per_step_((lines_ + std::max<std::int64_t>(steps, 1) - 1) / std::max<std::int64_t>(steps, 1)) {}
  // Rows [r0, r1) of a row-major matrix of elem_bytes elements, row stride ldb, n used per row
  // (nothing when r1 <= r0).
  static FetchAhead rows(const void* b, std::int64_t elem_bytes, std::int64_t ldb, std::int64_t n, std::int64_t r0,
                         std::int64_t r1, std::int64_t steps) {
    if (r1 <= r0) return FetchAhead(nullptr, 0, steps);
    return FetchAhead(static_cast<const char*>(b) + r0 * ldb * elem_bytes, ((r1 - r0 - 1) * ldb + n) * elem_bytes, steps);
  }
  void step() {
    for (const std::int64_t stop = std::min(lines_, line_ + per_step_); line_ < stop; ++line_)
      __builtin_prefetch(from_ + line_ * 64, 0, 3);
  }

 private:
  const char* from_;
  std::int64_t lines_, per_step_, line_ = 0;
};

// The next row tile's rows of a row-major left operand (m rows of row_bytes), which a tile fetches
// during its first panel of the group, spread over the steps of its sum (fetch_evenly): a layer's
// input comes from memory (the first group) or L3 (the others), and 14 rows read side by side are
// more streams than the hardware prefetchers follow well. Measured on the deep MLP's step, steps
// alternating in one process (Zen 5): float32 1.5-2.0% faster, plain and with remat every layer
// (into L2 only: 0.7-1.6%); bf16 plain 0-1.8% (mean of steps 0.6-2.3%), remat every layer 1.7-2.2%.
// None after the last tile.
struct TileFetch {
  const char* from = nullptr;
  std::int64_t lines = 0;
};
inline TileFetch next_tile_rows(const void* a, std::int64_t m, std::int64_t row_bytes, std::int64_t t) {
  const std::int64_t first = (t + 1) * kTileRows;
  if (first >= m) return {};
  const std::int64_t rows = std::min<std::int64_t>(kTileRows, m - first);
  return {static_cast<const char*>(a) + first * row_bytes, (rows * row_bytes + 63) / 64};
}
// The same for a transposed A packed into panels of panel_bytes (one per row tile): the next
// tile's panel. The packing wrote them just before, but a weight gradient's are 2 MB (the deep
// MLP's layer input, 2048 x 512 in bf16), more than L2 holds: they come back from L3. Measured on
// the deep MLP's bf16 step, steps alternating in one process (Zen 5): 1.0-2.0% faster by the best
// step, 1.8-2.5% by the mean.
inline TileFetch next_tile_panel(const void* a_panels, std::int64_t m, std::int64_t panel_bytes, std::int64_t t) {
  if ((t + 1) * kTileRows >= m) return {};
  return {static_cast<const char*>(a_panels) + (t + 1) * panel_bytes, panel_bytes / 64};
}
// At step q of a sum of `steps` steps, the lines of `f` below (q + 1) * f.lines / steps not yet
// fetched (`fetched` counts them), into L1.
inline void fetch_evenly(const TileFetch& f, std::int64_t q, std::int64_t steps, std::int64_t& fetched) {
  for (const std::int64_t stop = (q + 1) * f.lines / steps; fetched < stop; ++fetched)
    __builtin_prefetch(f.from + fetched * 64, 0, 3);
}

class PanelSchedule {
 public:
  static constexpr std::int64_t kGroupBytes = 512 * 1024;
  static constexpr std::int64_t kTilesPerItem = 4;
  static constexpr std::int64_t kTailTiles = 8;

  struct Item {
    std::int64_t t0, t1;  // row tiles
    std::int64_t p0, p1;  // panels
  };

  // m rows in tiles of tile_rows; panel_count panels of panel_bytes each.
  PanelSchedule(std::int64_t m, std::int64_t panel_count, std::int64_t panel_bytes, std::int64_t tile_rows)
      : panel_count_(panel_count),
        group_(std::clamp<std::int64_t>(kGroupBytes / std::max<std::int64_t>(panel_bytes, 1), 1,
                                        std::max<std::int64_t>(panel_count, 1))),
        row_tiles_((m + tile_rows - 1) / tile_rows),
        big_(std::max<std::int64_t>(0, (row_tiles_ - kTailTiles) / kTilesPerItem)),
        per_group_(big_ + (row_tiles_ - big_ * kTilesPerItem)) {}

  std::int64_t items() const { return (panel_count_ + group_ - 1) / group_ * per_group_; }

  Item item(std::int64_t i) const {
    const std::int64_t g = i / per_group_, c = i % per_group_;
    const std::int64_t t0 = c < big_ ? c * kTilesPerItem : big_ * kTilesPerItem + (c - big_);
    return Item{t0, c < big_ ? t0 + kTilesPerItem : t0 + 1, g * group_, std::min(panel_count_, (g + 1) * group_)};
  }

 private:
  std::int64_t panel_count_, group_, row_tiles_, big_, per_group_;
};

// A panel product on the team: the packing units of B (pack_b(u) for u < b_units) and of a
// transposed A (pack_a(u) for u < a_units), shared statically, then after a barrier the schedule's
// items (run_item(schedule.item(i))), shared dynamically. One thread for products under
// kParallelGemmWork multiply-adds, and inside another team.
template <class PackB, class PackA, class RunItem>
void run_panel_product([[maybe_unused]] double work, std::int64_t b_units, const PackB& pack_b, std::int64_t a_units,
                       const PackA& pack_a, const PanelSchedule& schedule, const RunItem& run_item) {
  [[maybe_unused]] int threads = 1;
#ifdef _OPENMP
  if (!omp_in_parallel() && work >= kParallelGemmWork) threads = team_size();
#pragma omp parallel num_threads(threads) if (threads > 1)
#endif
  {
    linum::detail::enter_compute();
#ifdef _OPENMP
#pragma omp for schedule(static) nowait
#endif
    for (std::int64_t u = 0; u < b_units; ++u) pack_b(u);
#ifdef _OPENMP
#pragma omp for schedule(static) nowait
#endif
    for (std::int64_t u = 0; u < a_units; ++u) pack_a(u);
#ifdef _OPENMP
#pragma omp barrier
#pragma omp for schedule(dynamic, 1)
#endif
    for (std::int64_t i = 0; i < schedule.items(); ++i) run_item(schedule.item(i));
  }
}

}  // namespace linum::kernels::detail
