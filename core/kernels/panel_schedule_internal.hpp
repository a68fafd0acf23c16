// Internal to the panel kernels (gemm_bf16_panels.cpp, gemm_f32_panels.cpp): how a product's tiles
// are dealt to the team. The right operand's panels go in groups of about kGroupBytes (they stay in
// L2 while every row tile passes over them); within a group, row tiles go in items of kTilesPerItem,
// except at least the last kTailTiles, taken one at a time, so that the threads finish within about
// one tile of each other. With only items of four, one thread sat idle for up to an item at the end
// of each product: 25-45 us of a 1.1 ms bf16 product on the MLP shapes; measured with the deep MLP's
// bf16 step alternating in one process, the tail split made it 1.1-2.3% faster. The items run group
// by group, in a dynamic schedule.
#pragma once

#include <algorithm>
#include <cstdint>

namespace linum::kernels::detail {

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
        group_(std::clamp<std::int64_t>(kGroupBytes / std::max<std::int64_t>(panel_bytes, 1), 1, std::max<std::int64_t>(panel_count, 1))),
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

}  // namespace linum::kernels::detail
