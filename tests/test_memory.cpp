#include <doctest/doctest.h>
#include <linum/linum.hpp>

#include <algorithm>
#include <vector>

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

TEST_CASE("the block cache sizes itself to the workload: a step's peak is kept, within the limit") {
  memory::set_cache_limit(std::int64_t{1} << 40);  // effectively unlimited: the workload decides
  auto step = [] {  // a "training step" holding 96 MiB at its peak, in 1 MiB buffers
    std::vector<Array> live;
    for (int i = 0; i < 96; ++i) live.push_back(Array::empty(Shape{1 << 18}));
    std::vector<const void*> addresses;
    for (const Array& a : live) addresses.push_back(a.raw());
    return addresses;
  };
  const auto first = step();
  const auto after = memory::stats();
  CHECK(after.high_water_bytes >= std::int64_t{96} << 20);
  CHECK(after.cached_bytes >= std::int64_t{96} << 20);  // every block of the step was kept
  CHECK(after.cached_bytes <= after.high_water_bytes);  // and never more than the workload's peak
  auto second = step();  // served entirely from the cache: the same blocks again
  std::sort(second.begin(), second.end());
  auto first_sorted = first;
  std::sort(first_sorted.begin(), first_sorted.end());
  CHECK(second == first_sorted);

  memory::set_cache_limit(std::int64_t{32} << 20);  // the user's cap wins over the workload
  (void)step();
  CHECK(memory::stats().cached_bytes <= std::int64_t{32} << 20);
  CHECK(memory::stats().cache_limit_bytes == std::int64_t{32} << 20);
  memory::set_cache_limit(std::int64_t{256} << 20);
}

TEST_CASE("a checkpoint's recomputation does not keep its outputs alive (FlatCall keeps only the first run's structure)") {
  const Array x = Array::ones(Shape{256, 256});
  const pytree::FlatCall<Array, Array> call(std::make_tuple(x));
  auto run = call.body([](const Array& a) { return a * 2.0f; });
  const std::int64_t before = memory::stats().live_bytes;
  Array first = call.rebuild(run());  // the forward pass
  const std::int64_t after_forward = memory::stats().live_bytes;
  (void)run();                         // a recomputation, its arrays dropped at once
  CHECK(memory::stats().live_bytes == after_forward);
  first = Array();
  CHECK(memory::stats().live_bytes == before);
}
