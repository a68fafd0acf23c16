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
  CHECK(after.cache_limit_bytes == after.high_water_bytes + after.high_water_bytes / 4);  // the mark and a quarter
  CHECK(after.cached_bytes <= after.cache_limit_bytes);
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

TEST_CASE("a step whose sizes peak at different moments is served entirely from the cache the second time") {
  // The sum over sizes of each size's own peak exceeds the step's peak (as in a real training step:
  // the deep MLP's bf16 step peaks at 147 MB and needs 154 MB of blocks). Every block must still be
  // kept, so the next step allocates nothing afresh (no page faults): the same addresses again.
  memory::release_cached();
  memory::set_cache_limit(std::int64_t{1} << 40);
  auto step = [] {
    std::vector<const void*> addresses;
    std::vector<Array> live;
    // (larger than the earlier cases' peaks: the high-water mark is the process's, never reset)
    for (int i = 0; i < 160; ++i) live.push_back(Array::empty(Shape{1 << 18}));  // 160 x 1 MiB
    for (const Array& a : live) addresses.push_back(a.raw());
    live.resize(140);  // 20 of them freed...
    for (int i = 0; i < 20; ++i) live.push_back(Array::empty(Shape{(1 << 18) + (1 << 14)}));  // ...20 x 1.06 MiB taken
    for (std::size_t i = 140; i < live.size(); ++i) addresses.push_back(live[i].raw());
    return addresses;
  };
  auto first = step();
  const auto after = memory::stats();
  const std::int64_t needed = (std::int64_t{160} << 20) + 20 * ((std::int64_t{1} << 20) + (std::int64_t{1} << 16));
  // The case means something only while the step's blocks exceed the mark (a bound of the mark
  // alone would refuse some): no earlier case may have raised the process's mark that far.
  REQUIRE(after.high_water_bytes < needed);
  CHECK(after.cached_bytes >= needed);
  auto second = step();
  std::sort(first.begin(), first.end());
  std::sort(second.begin(), second.end());
  CHECK(second == first);

  // Past the bound the cache refuses: two more sets of blocks, each about the step's size and of a
  // size of its own (so neither reuses the other's blocks), are freed; the cache stops at its limit.
  for (const std::int64_t words : {(std::int64_t{1} << 18) + (std::int64_t{1} << 15), (std::int64_t{1} << 18) + (std::int64_t{3} << 14)}) {
    std::vector<Array> live;
    for (int i = 0; i < 150; ++i) live.push_back(Array::empty(Shape{words}));
  }
  const auto full = memory::stats();
  CHECK(full.cache_limit_bytes == full.high_water_bytes + full.high_water_bytes / 4);
  CHECK(full.cached_bytes <= full.cache_limit_bytes);
  CHECK(full.cached_bytes > full.high_water_bytes);  // more than the mark alone would have kept
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

namespace {

struct Block {
  Array operator()(Scope& s, const Array& x) const { return gelu(s(nn::Dense{.features = 64}, gelu(s(nn::Dense{.features = 256}, x)))); }
};
template <class B>
struct Deep {
  Array operator()(Scope& s, Array x) const {
    for (int i = 0; i < 6; ++i) x = s(B{}, x);
    return x;
  }
};

// A training step recorded as a timeline, with the exact accounting's peak over the same step.
template <class M>
std::pair<memory::Timeline, std::int64_t> recorded_step(const std::string& label, const Tree& vars, const Array& x) {
  memory::TimelineRecorder rec(label);
  memory::PeakScope peak;
  (void)value_and_grad([&](const Tree& p) { return sum(apply(M{}, Tree{{"params", p}}, x)); })(vars.at("params"));
  return {rec.finish(), peak.peak_bytes()};
}

// A small well-formedness check: every tag closed in order, attribute values quoted.
bool well_formed_xml(const std::string& s) {
  std::vector<std::string> open;
  for (std::size_t i = s.find('<'); i != std::string::npos; i = s.find('<', i + 1)) {
    const std::size_t end = s.find('>', i);
    if (end == std::string::npos) return false;
    std::string tag = s.substr(i + 1, end - i - 1);
    if (tag.find('<') != std::string::npos) return false;
    if (std::count(tag.begin(), tag.end(), '"') % 2 != 0) return false;
    if (tag.starts_with("/")) {
      if (open.empty() || open.back() != tag.substr(1)) return false;
      open.pop_back();
    } else if (!tag.ends_with("/")) {
      open.push_back(tag.substr(0, tag.find(' ')));
    }
  }
  return open.empty();
}

}  // namespace

TEST_CASE("memory timeline: the peak of a recorded step is the accounting's peak; phases and module paths are tagged") {
  const Array x = linum::rng::normal(rng::key(1), Shape{512, 64});  // activations dominate the parameters
  const Tree vars = init(Deep<Block>{}, rng::key(0), x);
  const auto [plain, plain_peak] = recorded_step<Deep<Block>>("plain", vars, x);
  const auto [remat, remat_peak] = recorded_step<Deep<lift::remat<Block>>>("remat", vars, x);
  CHECK(plain.peak_bytes() == plain_peak);
  CHECK(remat.peak_bytes() == remat_peak);
  CHECK(remat.peak_bytes() < plain.peak_bytes());  // remat's saving shows in the timeline
  auto count = [](const memory::Timeline& t, const std::string& phase) {
    return std::count_if(t.points.begin(), t.points.end(), [&](const auto& p) { return p.phase == phase; });
  };
  CHECK(count(plain, "forward") > 0);
  CHECK(count(plain, "backward") > 0);
  CHECK(count(plain, "recomputation") == 0);
  CHECK(count(remat, "recomputation") > 0);
  // Forward and backward points carry the module path of their op.
  auto has = [](const memory::Timeline& t, const std::string& phase, const std::string& path, const std::string& op) {
    return std::any_of(t.points.begin(), t.points.end(),
                       [&](const auto& p) { return p.phase == phase && p.path == path && p.op == op; });
  };
  CHECK(has(plain, "forward", "Block_3/Dense_1", "linear"));
  CHECK(has(plain, "backward", "Block_3/Dense_1", "linear"));
  CHECK(has(remat, "recomputation", "Block_2/Dense_0", "linear"));
  for (std::size_t i = 1; i < plain.points.size(); ++i) CHECK(plain.points[i].seconds >= plain.points[i - 1].seconds);
  // JSON round trip and the SVG: well formed, one curve per run carrying its exact peak.
  const memory::Timeline back = memory::Timeline::from_json(nlohmann::json::parse(remat.to_json().dump()));
  CHECK(back.points.size() == remat.points.size());
  CHECK(back.peak_bytes() == remat.peak_bytes());
  const std::string svg = memory::render_svg({plain, remat});
  CHECK(svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
  CHECK(well_formed_xml(svg));
  CHECK(svg.find("data-label=\"plain\" data-peak-bytes=\"" + std::to_string(plain_peak) + "\"") != std::string::npos);
  CHECK(svg.find("data-label=\"remat\" data-peak-bytes=\"" + std::to_string(remat_peak) + "\"") != std::string::npos);
  CHECK(svg.find("plain: peak ") != std::string::npos);
  // above_start: each curve drawn above what was live when its recording started.
  const std::string above = memory::render_svg({plain, remat}, {.above_start = true});
  CHECK(well_formed_xml(above));
  CHECK(above.find("data-label=\"plain\" data-peak-bytes=\"" + std::to_string(plain_peak - plain.points.front().live_bytes) + "\"") !=
        std::string::npos);
  CHECK(above.find("data-label=\"remat\" data-peak-bytes=\"" + std::to_string(remat_peak - remat.points.front().live_bytes) + "\"") !=
        std::string::npos);
  CHECK(above.find("array memory above the start (MiB)") != std::string::npos);
  CHECK_FALSE(well_formed_xml("<svg><g></svg></g>"));  // the checker itself can fail
  CHECK_THROWS_AS(memory::Timeline::from_json(nlohmann::json{{"label", "x"}}), IoError);
}

TEST_CASE("memory timeline: one recorder at a time; not recording costs no points") {
  memory::TimelineRecorder rec("a");
  CHECK_THROWS_WITH_AS(memory::TimelineRecorder("b"), doctest::Contains("another recorder is active"), ValueError);
  const memory::Timeline t = rec.finish();
  CHECK(t.points.size() == 1);  // the start point only
  CHECK_THROWS_AS(rec.finish(), ValueError);
  memory::TimelineRecorder again("c");  // finished: a new one may start
}
