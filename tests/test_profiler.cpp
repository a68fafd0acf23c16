// The time profiler (core/profiler.hpp): which spans a step records (ops in every phase, backward
// rules, ranges), that they nest, that self times add up, that FLOPs are the products' and the
// convolutions' exact counts, module paths, the table and the Chrome trace.
#include <doctest/doctest.h>
#include <linum/linum.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <thread>
#include <unistd.h>

using namespace linum;

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

constexpr std::int64_t kBatch = 128, kIn = 64, kHidden = 256;

template <class M>
profiler::Profile profiled_step(const Tree& vars, const Array& x) {
  profiler::Profiler prof;
  {
    profiler::Range step("train step");
    (void)value_and_grad([&](const Tree& p) { return sum(apply(M{}, Tree{{"params", p}}, x)); })(vars.at("params"));
  }
  return prof.finish();
}

const profiler::OpStats* row(const std::vector<profiler::OpStats>& rows, const std::string& name, const std::string& kind,
                             const std::string& phase) {
  for (const auto& r : rows)
    if (r.name == name && r.kind == kind && r.phase == phase) return &r;
  return nullptr;
}

// Every span lies inside one at the depth above on its thread; self <= total; the self times of a
// thread add up to its outermost spans' totals.
void check_nesting(const profiler::Profile& p) {
  std::map<int, double> self_sum, outer_sum;
  for (const profiler::Event& e : p.events) {
    CHECK(e.total_s >= 0);
    CHECK(e.self_s >= 0);
    CHECK(e.self_s <= e.total_s + 1e-12);
    CHECK(e.start_s >= 0);
    CHECK(e.start_s + e.total_s <= p.wall_s + 1e-9);
    self_sum[e.thread] += e.self_s;
    if (e.depth == 0) {
      outer_sum[e.thread] += e.total_s;
      continue;
    }
    const bool enclosed = std::any_of(p.events.begin(), p.events.end(), [&](const profiler::Event& o) {
      return o.thread == e.thread && o.depth == e.depth - 1 && o.start_s <= e.start_s + 1e-9 &&
             e.start_s + e.total_s <= o.start_s + o.total_s + 1e-9;
    });
    CHECK_MESSAGE(enclosed, e.name, " at depth ", e.depth, " has no enclosing span");
  }
  for (const auto& [thread, s] : self_sum) CHECK(s == doctest::Approx(outer_sum[thread]).epsilon(1e-9));
}

}  // namespace

TEST_CASE("profiler: a training step's ops and backward rules, nested in a range, with exact product FLOPs and module paths") {
  const Array x = linum::rng::normal(rng::key(1), Shape{kBatch, kIn});
  const Tree vars = init(Deep<Block>{}, rng::key(0), x);
  const profiler::Profile p = profiled_step<Deep<Block>>(vars, x);
  check_nesting(p);
  const auto rows = p.key_averages();
  const profiler::OpStats* fwd = row(rows, "linear", "op", "forward");
  const profiler::OpStats* rule = row(rows, "linear", "rule", "backward");
  const profiler::OpStats* range = row(rows, "train step", "range", "forward");
  REQUIRE(fwd != nullptr);
  REQUIRE(rule != nullptr);
  REQUIRE(range != nullptr);
  CHECK(fwd->calls == 12);  // 6 blocks x 2 Dense
  CHECK(rule->calls == 12);
  CHECK(range->calls == 1);
  CHECK(row(rows, "gelu", "op", "forward")->calls == 12);
  CHECK(row(rows, "linear", "op", "recomputation") == nullptr);  // no remat here
  // Every Dense is a 64 x 256 or 256 x 64 product over the batch: 2 * B * 64 * 256 FLOPs forward;
  // backward its kernel's gradient, and its input's for all but the first (the data needs none).
  const double one = 2.0 * kBatch * kIn * kHidden;
  CHECK(fwd->flops == 12 * one);
  CHECK(rule->flops == (12 + 11) * one);
  CHECK(row(rows, "gelu", "op", "forward")->flops == 0);
  // The range encloses the step: every other span is inside it.
  for (const profiler::Event& e : p.events) {
    if (e.kind == "range") CHECK(e.depth == 0);
    else if (e.thread == 0) CHECK(e.depth >= 1);
  }
  CHECK(range->total_s <= p.wall_s);
  CHECK(range->total_s >= fwd->total_s + rule->total_s);
  // Module paths, forward and backward.
  auto has = [&](const std::string& kind, const std::string& path) {
    return std::any_of(p.events.begin(), p.events.end(),
                       [&](const profiler::Event& e) { return e.name == "linear" && e.kind == kind && e.path == path; });
  };
  CHECK(has("op", "Block_3/Dense_1"));
  CHECK(has("rule", "Block_3/Dense_1"));
  CHECK(has("rule", "Block_0/Dense_0"));
}

TEST_CASE("profiler: a rematerialized block's forward runs again as the recomputation phase") {
  const Array x = linum::rng::normal(rng::key(1), Shape{kBatch, kIn});
  const Tree vars = init(Deep<Block>{}, rng::key(0), x);
  const profiler::Profile p = profiled_step<Deep<lift::remat<Block>>>(vars, x);
  check_nesting(p);
  const auto rows = p.key_averages();
  REQUIRE(row(rows, "linear", "op", "recomputation") != nullptr);
  CHECK(row(rows, "linear", "op", "forward")->calls == 12);
  CHECK(row(rows, "linear", "op", "recomputation")->calls == 12);
  CHECK(row(rows, "linear", "op", "recomputation")->flops == 12 * 2.0 * kBatch * kIn * kHidden);
  CHECK(row(rows, "linear", "rule", "backward")->calls == 12);
  CHECK(std::any_of(p.events.begin(), p.events.end(), [](const profiler::Event& e) {
    return e.phase == "recomputation" && e.path == "Block_2/Dense_0";
  }));
}

TEST_CASE("profiler: convolution FLOPs, forward and both gradients") {
  const Array x = linum::rng::normal(rng::key(2), Shape{2, 9, 7, 3});
  const Array w = linum::rng::normal(rng::key(3), Shape{3, 3, 3, 4});
  ConvOptions o;
  o.strides = {2, 1};
  profiler::Profiler prof;
  (void)value_and_grad([&](const std::vector<Array>& xw) { return sum(conv2d(xw[0], xw[1], o)); })(std::vector<Array>{x, w});
  const profiler::Profile p = prof.finish();
  const auto rows = p.key_averages();
  // SAME padding, strides (2, 1): a 5 x 7 output; 2 FLOPs per output element, tap and channel.
  const double pass = 2.0 * 2 * 5 * 7 * 4 * 3 * 3 * 3;
  REQUIRE(row(rows, "conv2d", "op", "forward") != nullptr);
  CHECK(row(rows, "conv2d", "op", "forward")->flops == pass);
  CHECK(row(rows, "conv2d", "rule", "backward")->flops == 2 * pass);
}

TEST_CASE("profiler: constants are timed too; input shapes; the table; the Chrome trace") {
  const Array a = Array::ones(Shape{4, 8}), b = Array::ones(Shape{8, 3});
  profiler::Profiler prof({.record_shapes = true});
  for (int i = 0; i < 3; ++i) (void)matmul(a, b);
  (void)exp(a);
  const profiler::Profile p = prof.finish();
  check_nesting(p);
  const auto rows = p.key_averages(true);
  const profiler::OpStats* mm = row(rows, "matmul", "op", "forward");
  REQUIRE(mm != nullptr);
  CHECK(mm->calls == 3);
  CHECK(mm->shapes == "(4, 8) (8, 3)");
  CHECK(mm->flops == 3 * 2.0 * 4 * 8 * 3);
  REQUIRE(row(rows, "exp", "op", "forward") != nullptr);

  const std::string table = p.table({.sort_by = "calls", .row_limit = 1, .group_by_shapes = true});
  CHECK(table.starts_with("Name"));
  CHECK(table.find("matmul") != std::string::npos);  // the most calls: the one row shown
  CHECK(table.find("(4, 8) (8, 3)") != std::string::npos);
  CHECK(table.find("more rows (row_limit)") != std::string::npos);
  CHECK(table.find("Wall time") != std::string::npos);
  for (const char* by : {"self", "total", "flops", "name"}) CHECK(p.table({.sort_by = by}).find("exp") != std::string::npos);
  CHECK_THROWS_WITH_AS(p.table({.sort_by = "speed"}), doctest::Contains("is not one of self, total, calls, flops, name"),
                       ValueError);

  const nlohmann::json trace = p.chrome_trace();
  std::size_t complete = 0;
  for (const auto& e : trace.at("traceEvents")) {
    if (e.at("ph") == "M") continue;
    ++complete;
    CHECK(e.at("ph") == "X");
    CHECK(e.at("dur").get<double>() >= 0);
    CHECK(e.contains("ts"));
    CHECK(e.contains("tid"));
  }
  CHECK(complete == p.events.size());
  const auto path = std::filesystem::temp_directory_path() / ("linum_profile_" + std::to_string(::getpid()) + ".json");
  p.save_chrome_trace(path);
  std::ifstream in(path);
  const nlohmann::json back = nlohmann::json::parse(in);
  CHECK(back == trace);
  std::filesystem::remove(path);
}

TEST_CASE("profiler: one at a time; nothing recorded after finish; each thread its own track") {
  profiler::Profiler prof;
  CHECK(profiler::profiling());
  CHECK_THROWS_WITH_AS(profiler::Profiler(), doctest::Contains("another profiler is recording"), ValueError);
  const Array a = Array::ones(Shape{16, 16});
  std::thread t1([&] { (void)matmul(a, a); });
  std::thread t2([&] { (void)matmul(a, a); });
  t1.join();
  t2.join();
  (void)matmul(a, a);
  const profiler::Profile p = prof.finish();
  CHECK_FALSE(profiler::profiling());
  CHECK_THROWS_AS(prof.finish(), ValueError);
  std::vector<int> threads;
  for (const profiler::Event& e : p.events) threads.push_back(e.thread);
  std::sort(threads.begin(), threads.end());
  threads.erase(std::unique(threads.begin(), threads.end()), threads.end());
  CHECK(threads == std::vector<int>{0, 1, 2});  // three threads, a track each
  (void)matmul(a, a);                           // not profiling: nothing is kept
  profiler::Profiler again;                     // finished: a new one may start, empty
  CHECK(again.finish().events.empty());
}
