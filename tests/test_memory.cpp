#include <doctest/doctest.h>
#include <linum/linum.hpp>

using namespace linum;

TEST_CASE("every buffer is accounted exactly and released") {
  auto before = memory::stats();
  {
    Array a = Array::zeros(Shape{3, 5});
    auto mid = memory::stats();
    CHECK(mid.live_bytes - before.live_bytes == 3 * 5 * 4);
    CHECK(mid.live_buffers - before.live_buffers == 1);
    CHECK(mid.allocations - before.allocations == 1);
    Array b = a;  // shares the buffer
    CHECK(memory::stats().live_bytes == mid.live_bytes);
    CHECK(reinterpret_cast<std::uintptr_t>(a.raw()) % 64 == 0);
  }
  CHECK(memory::stats().live_bytes == before.live_bytes);
}

TEST_CASE("PeakScope measures the peak inside a block, and scopes nest") {
  memory::PeakScope outer;
  {
    Array big = Array::zeros(Shape{1000});  // 4000 bytes
  }
  std::int64_t inner_growth = 0;
  {
    memory::PeakScope inner;
    Array small = Array::zeros(Shape{10});
    inner_growth = inner.peak_growth();
  }
  CHECK(inner_growth == 40);
  CHECK(outer.peak_growth() == 4000);  // the inner scope did not hide the outer peak
  memory::reset_peak();
  CHECK(memory::stats().peak_bytes == memory::stats().live_bytes);
}

TEST_CASE("large freed blocks are cached for reuse without counting as live bytes") {
  memory::release_cached();
  const auto before = memory::stats();
  CHECK(before.cached_bytes == 0);
  const void* address = nullptr;
  {
    Array big = Array::zeros(Shape{1 << 16});  // 256 KiB
    address = big.raw();
  }
  const auto freed = memory::stats();
  CHECK(freed.live_bytes == before.live_bytes);  // exact accounting is unchanged
  CHECK(freed.cached_bytes == 1 << 18);
  {
    Array again = Array::zeros(Shape{1 << 16});
    CHECK(again.raw() == address);  // the same block, reused
    CHECK(memory::stats().cached_bytes == 0);
    CHECK(memory::stats().live_bytes - before.live_bytes == 1 << 18);
  }
  memory::set_cache_limit(0);  // no caching: blocks go straight back
  { Array big = Array::zeros(Shape{1 << 16}); }
  CHECK(memory::stats().cached_bytes == 0);
  memory::set_cache_limit(std::int64_t{256} << 20);
}
