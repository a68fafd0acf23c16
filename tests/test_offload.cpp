// Residuals beyond recompute: the spill file (offload to disk), compression codecs, policies that
// place kept values, ResidualScope for plain graphs. Offloading is lossless: every gradient is
// checked bitwise against the plain model's, for every kind of model. Compression is checked
// against its documented error bounds.
#include <doctest/doctest.h>
#include <linum/linum.hpp>
#include <linum/core/storage/stored_array.hpp>
#include <linum/lift/residual_scope.hpp>

#include "testing/errors.hpp"
#include "testing/gradcheck.hpp"

#include <cmath>
#include <csignal>
#include <filesystem>
#include <functional>
#include <random>

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

using namespace linum;
using linum::testing::random_array;
namespace fs = std::filesystem;

namespace {

// A fresh empty directory for one test's spill file.
fs::path fresh_dir(const std::string& name) {
  fs::path d = fs::temp_directory_path() / ("linum-offload-test-" + std::to_string(::getpid()) + "-" + name);
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}
bool empty_dir(const fs::path& d) { return fs::is_empty(d); }

// Values spanning many magnitudes (and signs), as activations and gradients do.
Array wide_values(const Shape& shape, unsigned seed, DType dtype) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::uniform_real_distribution<float> e(-12.0f, 6.0f);
  std::vector<float> v(static_cast<std::size_t>(shape.numel()));
  for (float& x : v) x = n(gen) * std::exp2(e(gen));
  Array a = Array::from(shape, v);
  return dtype == DType::f32 ? a : astype(a, dtype);
}

const storage::Codec kCodecs[] = {storage::Codec::bf16, storage::Codec::int8, storage::Codec::fp8_e4m3};
const DType kFloatTypes[] = {DType::f32, DType::bf16};

}  // namespace

// ---- codecs ---------------------------------------------------------------------------------

TEST_CASE("every fp8 e4m3 code decodes and encodes back to itself; rounding is to nearest even, saturating") {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;  // NaN codes
    const auto code = static_cast<std::uint8_t>(c);
    const float v = storage::e4m3_to_float(code);
    CHECK(storage::float_to_e4m3(v) == (v == 0.0f ? (c & 0x80 ? 0x80 : 0) : code));
  }
  CHECK(storage::e4m3_to_float(0x7e) == 448.0f);
  CHECK(storage::e4m3_to_float(0x01) == std::ldexp(1.0f, -9));  // the smallest subnormal
  CHECK(storage::float_to_e4m3(1000.0f) == 0x7e);                 // saturates
  CHECK(storage::float_to_e4m3(-1000.0f) == 0xfe);
  // 1 + 1/16 lies halfway between 1 and 1.125: ties go to the even mantissa (1.0).
  CHECK(storage::e4m3_to_float(storage::float_to_e4m3(1.0625f)) == 1.0f);
  CHECK(storage::e4m3_to_float(storage::float_to_e4m3(1.1875f)) == 1.25f);  // halfway 1.125..1.25: even is 1.25
}

TEST_CASE("compression keeps each element within the codec's documented bound, for every codec, dtype and size") {
  for (storage::Codec codec : kCodecs)
    for (DType dtype : kFloatTypes)
      for (std::int64_t n : {0, 1, 255, 256, 257, 1000}) {
        CAPTURE(storage::codec_name(codec));
        CAPTURE(std::string(dtype_name(dtype)));
        CAPTURE(n);
        const Array x = wide_values(Shape{n}, static_cast<unsigned>(n) + 3, dtype);
        const storage::Compressed c = storage::compress(x, codec);
        const bool kept = codec == storage::Codec::bf16 && dtype == DType::bf16;  // already bf16
        CHECK(c.codec == (kept ? storage::Codec::none : codec));
        CHECK(static_cast<std::int64_t>(c.payload.nbytes()) == storage::compressed_size(x.shape(), dtype, kept ? storage::Codec::none : codec));
        const Array y = storage::decompress(c);
        REQUIRE(y.shape() == x.shape());
        REQUIRE(y.dtype() == x.dtype());
        const std::vector<float> xv = x.to_vector(), yv = y.to_vector();
        for (std::int64_t b = 0; b * storage::kBlock < n; ++b) {
          const std::int64_t lo = b * storage::kBlock, hi = std::min(n, lo + storage::kBlock);
          float m = 0.0f;
          for (std::int64_t i = lo; i < hi; ++i) m = std::max(m, std::fabs(xv[static_cast<std::size_t>(i)]));
          for (std::int64_t i = lo; i < hi; ++i) {
            const float xi = xv[static_cast<std::size_t>(i)], err = std::fabs(xi - yv[static_cast<std::size_t>(i)]);
            float bound = 0.0f;
            if (codec == storage::Codec::bf16) bound = std::ldexp(std::fabs(xi), -8);
            if (codec == storage::Codec::int8) bound = m / 254.0f;
            if (codec == storage::Codec::fp8_e4m3) bound = std::max(std::ldexp(std::fabs(xi), -4), m / (448.0f * 1024.0f));
            // One float rounding of the scale product, and bfloat16's own rounding on the way back.
            bound = bound * (1.0f + 1e-6f) + std::fabs(xi) * (dtype == DType::bf16 ? std::ldexp(1.0f, -8) : 1e-6f);
            if (err > bound) {
              FAIL_CHECK("element ", i, ": ", xi, " came back as ", yv[static_cast<std::size_t>(i)], " (error ", err, " > bound ", bound, ")");
              break;
            }
          }
        }
        if (codec != storage::Codec::bf16)  // 1 byte per element, 4 per block of 256
          CHECK(static_cast<std::int64_t>(c.payload.nbytes()) <= n + 4 * ((n + storage::kBlock - 1) / storage::kBlock) + 3);
      }
}

TEST_CASE("arrays with a NaN or an infinity, and integer arrays, are kept exactly") {
  for (storage::Codec codec : kCodecs) {
    Array x = Array::from(Shape{4}, {1.0f, NAN, 2.0f, -3.0f});
    Array inf = Array::from(Shape{3}, {1.0f, INFINITY, 0.5f});
    Array ints = Array::from_i32(Shape{3}, {1, 2, 3});
    for (const Array& a : {x, inf, ints}) {
      const storage::Compressed c = storage::compress(a, codec);
      CHECK(c.codec == storage::Codec::none);
      CHECK(storage::decompress(c).bitwise_equal(a));
    }
  }
  CHECK_THROWS_AS(storage::codec_from_name("int4"), ValueError);
  CHECK(storage::placement_from_string("disk+int8") == storage::Placement{storage::Where::disk, storage::Codec::int8});
  for (const char* s : {"ram", "disk", "bf16", "fp8_e4m3", "disk+bf16"}) CHECK(storage::placement_from_string(s).str() == s);
  CHECK_THROWS_AS(storage::placement_from_string("tape"), ValueError);
}

// ---- the spill file ---------------------------------------------------------------------------

TEST_CASE("the spill file gives back every array bit for bit, releases its RAM, and has no name in its directory") {
  const fs::path dir = fresh_dir("roundtrip");
  storage::SpillFile spill = storage::SpillFile::open({.directory = dir, .write_behind_bytes = 1 << 20, .read_ahead_bytes = 1 << 20});
  CHECK(empty_dir(dir));
  const auto before = memory::stats();
  const storage::TransferStats moved_before = storage::transfer_stats();
  std::vector<Array> originals;
  std::vector<std::shared_ptr<storage::SpillFile::Entry>> entries;
  for (int i = 0; i < 12; ++i) {
    Array a = i % 3 == 0 ? random_array(Shape{64, 33}, static_cast<unsigned>(i))
              : i % 3 == 1 ? astype(random_array(Shape{17, 9}, static_cast<unsigned>(i)), DType::bf16)
                           : Array::arange(100 + i);
    originals.push_back(a);  // arrays are immutable: this is the value the file must give back
    entries.push_back(spill.put(a));
  }
  entries.push_back(spill.put(Array::zeros(Shape{0, 4})));  // empty arrays too
  spill.flush();
  CHECK(empty_dir(dir));  // unnamed: a crash cannot leave it behind
  const auto written = memory::stats();
  CHECK(written.offload_written_bytes > before.offload_written_bytes);
  CHECK(written.offloaded_bytes > before.offloaded_bytes);
  CHECK(spill.used_bytes() > 0);
  // In reverse order, as a backward pass reads them.
  for (std::size_t i = entries.size(); i-- > 0;) {
    const Array back = spill.get(*entries[i]);
    if (i == originals.size()) {
      CHECK(back.shape() == Shape{0, 4});
    } else {
      CHECK(back.bitwise_equal(originals[i]));
      CHECK(spill.get(*entries[i]).bitwise_equal(originals[i]));  // a second read works too
    }
    entries.pop_back();  // freed: the file shrinks from its end
  }
  CHECK(spill.used_bytes() == 0);
  CHECK(memory::stats().offloaded_bytes == before.offloaded_bytes);
  CHECK(memory::stats().offload_read_bytes > before.offload_read_bytes);
  // The transfers were timed: what the planner reports as the directory's bandwidth.
  const storage::TransferStats moved = storage::transfer_stats() - moved_before;
  CHECK(moved.written_bytes == written.offload_written_bytes - before.offload_written_bytes);
  CHECK(moved.read_bytes == memory::stats().offload_read_bytes - before.offload_read_bytes);
  CHECK(moved.write_seconds > 0);
  CHECK(moved.read_bytes_per_s() > 0);
  fs::remove_all(dir);
}

TEST_CASE("an array handed to the spill file leaves RAM once written") {
  const fs::path dir = fresh_dir("ram");
  storage::SpillFile spill = storage::SpillFile::open({.directory = dir});
  const std::int64_t before = memory::stats().live_bytes;
  std::shared_ptr<storage::SpillFile::Entry> e;
  {
    Array big = Array::full(Shape{1 << 18}, 1.5f);  // 1 MiB
    e = spill.put(big);
  }
  spill.flush();
  CHECK(memory::stats().live_bytes == before);
  CHECK(spill.get(*e).bitwise_equal(Array::full(Shape{1 << 18}, 1.5f)));
  fs::remove_all(dir);
}

TEST_CASE("a missing spill directory is an IoError naming it") {
  try {
    storage::SpillFile::open({.directory = "/nonexistent/linum-spill"});
    FAIL("no error");
  } catch (const IoError& e) {
    CHECK(std::string(e.what()).find("/nonexistent/linum-spill") != std::string::npos);
    CHECK(std::string(e.what()).find("does not exist") != std::string::npos);
  }
}

TEST_CASE("a process killed in the middle of offloading leaves no file behind") {
  const fs::path dir = fresh_dir("killed");
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    storage::SpillFile spill = storage::SpillFile::open({.directory = dir});
    std::vector<std::shared_ptr<storage::SpillFile::Entry>> keep;
    for (int i = 0; i < 64; ++i) keep.push_back(spill.put(Array::full(Shape{1 << 16}, static_cast<float>(i))));
    ::kill(::getpid(), SIGKILL);  // mid-step, writes in flight
    ::_exit(0);
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  CHECK(WIFSIGNALED(status));
  CHECK(empty_dir(dir));
  fs::remove_all(dir);
}

TEST_CASE("a full disk is a clear error naming the directory, and nothing stored is lost") {
  const fs::path dir = fresh_dir("full");
  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    // A 1 MiB file size limit stands in for a full disk (EFBIG, as ENOSPC: the write fails).
    ::signal(SIGXFSZ, SIG_IGN);
    struct rlimit lim{1 << 20, 1 << 20};
    ::setrlimit(RLIMIT_FSIZE, &lim);
    std::string result = "no error";
    storage::SpillFile spill = storage::SpillFile::open({.directory = dir});
    std::vector<std::shared_ptr<storage::SpillFile::Entry>> keep;
    try {
      for (int i = 0; i < 16; ++i) {
        keep.push_back(spill.put(Array::full(Shape{1 << 16}, static_cast<float>(i))));  // 256 KiB each
        spill.flush();
      }
    } catch (const IoError& e) {
      result = e.what();
      bool intact = true;  // every entry still reads back its value
      for (std::size_t i = 0; i < keep.size(); ++i)
        intact = intact && spill.get(*keep[i]).bitwise_equal(Array::full(Shape{1 << 16}, static_cast<float>(i)));
      if (!intact) result = "lost data";
    }
    (void)!::write(fds[1], result.data(), result.size());
    ::_exit(0);
  }
  ::close(fds[1]);
  std::string msg;
  char buf[512];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) msg.append(buf, static_cast<std::size_t>(n));
  ::close(fds[0]);
  ::waitpid(child, nullptr, 0);
  CAPTURE(msg);
  CHECK(msg.find(dir.string()) != std::string::npos);
  CHECK(msg.find("failed") != std::string::npos);
  CHECK(empty_dir(dir));
  fs::remove_all(dir);
}

// ---- policies and models --------------------------------------------------------------------

namespace {

struct Mlp {
  Array operator()(Scope& s, Array x) const {
    for (int i = 0; i < 3; ++i) x = gelu(s(nn::Dense{.features = 16}, x));
    return s(nn::Dense{.features = 4}, x);
  }
};
struct ConvNet {
  Array operator()(Scope& s, Array x) const {
    x = relu(s(nn::Conv{.features = 6, .kernel_size = {3, 3}}, x));
    x = s(nn::LayerNorm{}, x);
    x = relu(s(nn::Conv{.features = 4, .kernel_size = {3, 3}, .strides = {2, 2}}, x));
    return mean(x, {1, 2});
  }
};
struct Attention {
  Array operator()(Scope& s, const Array& x) const {
    Array h = s(nn::MultiHeadDotProductAttention{.num_heads = 2, .qkv_features = 8}, x, x);
    return s(nn::Dense{.features = 3}, gelu(h + x));
  }
};
struct ScanCell {
  std::pair<Array, Array> operator()(Scope& s, const Array& h, const Array& x) const {
    Array next = tanh(s(nn::Dense{.features = 8}, h) + x);
    return {next, gelu(next)};
  }
};
struct Scanned {
  Array operator()(Scope& s, const Array& xs) const {
    Array h0 = Array::zeros(Shape{xs.dim(1), xs.dim(2)});
    auto [h, ys] = s(lift::scan<ScanCell>{.variable_broadcast = {"params"}, .split_rngs = {{"params", false}}}, h0,
                     lift::scanned(xs));
    return ys + h;
  }
};
struct Lstm {
  Array operator()(Scope& s, const Array& xs) const { return s(nn::RNN<nn::LSTMCell>{.cell = {.features = 8}}, xs); }
};

struct Case {
  const char* name;
  std::function<Tree()> init_params;
  std::function<Array(const Tree&)> loss;
};

template <class M>
Case make_case(const char* name, M model, Array x) {
  return {name, [=] { return init(model, rng::key(0), x).at("params"); },
          [=](const Tree& p) { return mean(square(apply(model, Tree{{"params", p}}, x))); }};
}

// offload(everything_saveable), counting the values it sends to disk.
lift::Policy counting_offload(std::shared_ptr<int> count) {
  const lift::Policy everything = policies::offload(policies::everything_saveable{});
  return lift::Policy("counting offload", lift::Policy::Decider([=](const lift::OpInfo& op) {
                        auto p = everything.decide(op);
                        if (p && p->where == storage::Where::disk) ++*count;
                        return p;
                      }));
}

std::vector<Case> models() {
  return {
      make_case("dense", Mlp{}, random_array(Shape{8, 16}, 1)),
      make_case("conv", ConvNet{}, random_array(Shape{2, 8, 8, 3}, 2)),
      make_case("attention", Attention{}, random_array(Shape{2, 5, 8}, 3)),
      make_case("scan", Scanned{}, random_array(Shape{6, 3, 8}, 4)),
      make_case("rnn", Lstm{}, random_array(Shape{3, 6, 5}, 5)),
  };
}

std::pair<Array, Tree> grads_of(const Case& c, const Tree& params) {
  auto [v, g] = value_and_grad(c.loss)(params);
  return {v, g};
}

struct SpillDir {
  fs::path dir = fresh_dir("models");
  SpillDir() { storage::set_spill_options({.directory = dir}); }
  ~SpillDir() { fs::remove_all(dir); }
};

}  // namespace

TEST_CASE("offloaded residuals give the plain model's gradients bit for bit: dense, conv, attention, scan, RNN") {
  SpillDir spill;
  const std::vector<std::pair<std::string, lift::Policy>> policies = {
      {"offload(everything)", policies::offload(policies::everything_saveable{})},
      {"offload(dots)", policies::offload(policies::dots_saveable{})},
      {"residuals(offload(everything))", policies::residuals(policies::offload(policies::everything_saveable{}))},
      {"offload(nothing): inputs on disk", policies::offload(policies::nothing_saveable{})},
      {"offload(compress(int8, nothing)): inputs on disk, exact", policies::offload(policies::compress(storage::Codec::int8, policies::nothing_saveable{}))},
  };
  for (const Case& c : models()) {
    CAPTURE(std::string(c.name));
    const Tree params = c.init_params();
    const auto [v0, g0] = grads_of(c, params);
    {  // plain graph, every computed residual in the spill file
      auto count = std::make_shared<int>(0);
      lift::ResidualScope scope(counting_offload(count));
      const auto [v, g] = grads_of(c, params);
      CHECK(v.bitwise_equal(v0));
      CHECK(bitwise_equal(g, g0));
      CHECK(*count > 0);
      storage::spill_file().flush();
      CHECK(storage::spill_file().used_bytes() == 0);  // everything freed after the backward pass
    }
    for (const auto& entry : policies) {  // every module call checkpointed, its kept values on disk
      const auto& name = entry.first;
      const auto& policy = entry.second;
      CAPTURE(name);
      lift::reset_recompute_stats();
      lift::RematScope remat({.mode = lift::RematMode::full, .policy = policy});
      const auto [v, g] = grads_of(c, params);
      CHECK(v.bitwise_equal(v0));
      CHECK(bitwise_equal(g, g0));
      if (policy.residual_placement() != nullptr) CHECK(lift::recompute_stats().checkpointed_calls == 0);  // plain calls
      else if (!policy.saves_nothing()) CHECK(lift::recompute_stats().values_saved > 0);
      else CHECK(lift::recompute_stats().recomputations > 0);
    }
  }
}

TEST_CASE("offload(p) keeps a checkpoint's inputs in the spill file: gradients bit for bit, the RAM between the passes drops") {
  SpillDir spill;
  storage::SpillWindowsScope timing_independent({0, 0});
  struct Block {
    Array operator()(Scope& s, const Array& x) const { return x + gelu(s(nn::Dense{.features = 64}, x)) * 0.5f; }
  };
  struct Stack {
    lift::Policy policy;
    Array operator()(Scope& s, Array x) const {
      for (int i = 0; i < 12; ++i) x = s(lift::remat<Block>{{}, policy}, x);
      return x;
    }
  };
  const Array x = random_array(Shape{512, 64}, 21);
  const std::int64_t input_bytes = 512 * 64 * 4;
  const Tree params = init(Stack{}, rng::key(0), x).at("params");
  auto run = [&](const lift::Policy& policy) {
    auto loss = [&](const Tree& p) { return mean(square(apply(Stack{policy}, Tree{{"params", p}}, x))); };
    memory::release_cached();
    const std::int64_t written = memory::stats().offload_written_bytes;
    memory::PeakScope peak;
    auto [v, g] = value_and_grad(loss)(params);
    return std::tuple(v, g, peak.peak_bytes(), memory::stats().offload_written_bytes - written);
  };
  const auto [v0, g0, peak0, written0] = run(policies::nothing_saveable{});
  CHECK(written0 == 0);
  for (const lift::Policy& policy : {policies::offload(policies::nothing_saveable{}), policies::offload(policies::dots_saveable{})}) {
    CAPTURE(policy.description());
    REQUIRE(policy.offloads_inputs());
    const auto [v, g, peak, written] = run(policy);
    CHECK(v.bitwise_equal(v0));
    CHECK(bitwise_equal(g, g0));
    CHECK(written >= 12 * input_bytes);  // every block's input went to disk
    // The remat peak holds all 12 inputs (the first recomputation); offloaded, the peak moves to the
    // last block, where the gradients have accumulated instead: at least half the inputs are gone.
    if (policy.saves_nothing()) CHECK(peak <= peak0 - 6 * input_bytes);
    storage::spill_file().flush();
    CHECK(storage::spill_file().used_bytes() == 0);
  }
  // A checkpointed function (its arguments, the same one twice, and a captured weight).
  const Array w = random_array(Shape{64, 64}, 22);
  auto f = [w](const Array& a, const Array& b) { return tanh(matmul(a, w)) * b; };
  auto loss = [&](auto g) { return [g](const Array& a) { return sum(square(g(a, a))); }; };
  const auto [fv0, fg0] = value_and_grad(loss(f))(x);
  const std::int64_t written = memory::stats().offload_written_bytes;
  const auto [fv, fg] = value_and_grad(loss(checkpoint(f, {.policy = policies::offload(policies::nothing_saveable{})})))(x);
  CHECK(fv.bitwise_equal(fv0));
  CHECK(fg.bitwise_equal(fg0));
  CHECK(memory::stats().offload_written_bytes - written == input_bytes);  // the argument passed twice, stored once
}

TEST_CASE("save_and_offload_only_these_names keeps one name in RAM, sends the other to disk, recomputes the rest") {
  SpillDir spill;
  const Array x = random_array(Shape{4, 8}, 7), w = random_array(Shape{8, 8}, 8);
  auto block = [](const Array& a, const Array& k) {
    Array h = checkpoint_name(matmul(a, k), "kept");
    Array g = checkpoint_name(gelu(h), "spilled");
    return tanh(matmul(g, k));
  };
  auto loss = [&](auto f) { return [f](const Array& a, const Array& k) { return sum(square(f(a, k))); }; };
  const auto [v0, gx0, gw0] = value_and_grad<0, 1>(loss(block))(x, w);
  const lift::Policy policy = policies::save_and_offload_only_these_names({"kept"}, {"spilled"});
  CHECK(policy.description() == "save_and_offload_only_these_names(kept; spilled)");
  CHECK(policies::from_description(policy.description()).description() == policy.description());
  const lift::OpInfo kept{"checkpoint_name", x.shape(), 128, "kept", "", DType::f32};
  const lift::OpInfo spilled{"checkpoint_name", x.shape(), 128, "spilled", "", DType::f32};
  const lift::OpInfo other{"tanh", x.shape(), 128, "", "", DType::f32};
  CHECK(policy.decide(kept) == storage::Placement{});
  CHECK(policy.decide(spilled) == storage::Placement{storage::Where::disk});
  CHECK_FALSE(policy.decide(other).has_value());
  lift::reset_recompute_stats();
  const auto [v, gx, gw] = value_and_grad<0, 1>(loss(checkpoint(block, {.policy = policy})))(x, w);
  CHECK(v.bitwise_equal(v0));
  CHECK(gx.bitwise_equal(gx0));
  CHECK(gw.bitwise_equal(gw0));
  CHECK(lift::recompute_stats().values_saved == 2);
  CHECK(lift::recompute_stats().ops_replayed == 2);  // both kept values reused, from RAM and from disk
}

TEST_CASE("policy descriptions of offload and compression restore the same decisions") {
  for (const lift::Policy& p : {policies::offload(policies::dots_saveable{}),
                                policies::compress(storage::Codec::int8, policies::everything_saveable{}),
                                policies::offload(policies::compress(storage::Codec::fp8_e4m3, policies::save_only_these_names({"a", "b"}))),
                                policies::save_and_offload_only_these_names({}, {"x"}),
                                policies::residuals(policies::compress(storage::Codec::bf16, policies::dots_saveable{}))}) {
    CAPTURE(p.description());
    const lift::Policy back = policies::from_description(p.description());
    CHECK(back.description() == p.description());
    CHECK(back.places_beyond_ram() == p.places_beyond_ram());
    CHECK((back.residual_placement() != nullptr) == (p.residual_placement() != nullptr));
    const Shape shape{4, 4};
    for (const char* op : {"matmul", "gelu", "checkpoint_name"})
      for (const char* name : {"", "a", "x"}) {
        const lift::OpInfo info{op, shape, 64, name, "", DType::f32};
        CHECK(back.decide(info) == p.decide(info));
      }
  }
  const lift::OpInfo dot{"matmul", Shape{2}, 8, "", "", DType::f32};
  CHECK(policies::offload(policies::compress(storage::Codec::int8, policies::dots_saveable{})).decide(dot) ==
        storage::Placement{storage::Where::disk, storage::Codec::int8});
  CHECK_FALSE(policies::offload(policies::everything_saveable{}).saves_everything());  // it still checkpoints
  CHECK(policies::offload(policies::dots_saveable{}).places_beyond_ram());
  CHECK(policies::offload(policies::nothing_saveable{}).places_beyond_ram());  // its inputs
  CHECK(policies::offload(policies::nothing_saveable{}).offloads_inputs());
  CHECK(policies::from_description("offload(compress(int8, dots_saveable))").offloads_inputs());
  CHECK(policies::save_from_both_policies(policies::offload(policies::nothing_saveable{}), policies::dots_saveable{}).offloads_inputs());
  CHECK_FALSE(policies::compress(storage::Codec::int8, policies::dots_saveable{}).offloads_inputs());  // inputs stay exact, in RAM
  CHECK_FALSE(policies::save_and_offload_only_these_names({}, {"x"}).offloads_inputs());  // JAX: names only
  CHECK_FALSE(lift::Policy(policies::dots_saveable{}).places_beyond_ram());
  const lift::Policy r = policies::from_description("residuals(offload(everything_saveable))");
  REQUIRE(r.residual_placement() != nullptr);
  CHECK(r.residual_placement()->description() == "offload(everything_saveable)");
  CHECK(r.places_beyond_ram());
}

TEST_CASE("compressed residuals: gradients within the codec's tolerance, and the memory they take") {
  const Case c = models()[0];
  const Tree params = c.init_params();
  const auto [v0, g0] = grads_of(c, params);
  const std::vector<Array> ref = leaves(g0);
  for (storage::Codec codec : kCodecs) {
    CAPTURE(storage::codec_name(codec));
    for (bool remat : {false, true}) {
      CAPTURE(remat);
      const lift::Policy policy = policies::compress(codec, policies::everything_saveable{});
      std::optional<lift::ResidualScope> scope;
      std::optional<lift::RematScope> rs;
      if (remat) rs.emplace(lift::RematScopeOptions{.mode = lift::RematMode::full, .policy = policy});
      else scope.emplace(policy);
      const auto [v, g] = grads_of(c, params);
      CHECK(v.bitwise_equal(v0));  // the forward pass is exact: only the backward reads copies
      const std::vector<Array> got = leaves(g);
      REQUIRE(got.size() == ref.size());
      // Relative error of each gradient (L2): bf16 keeps 8 bits, fp8 4, int8 about 7 over the block.
      const double tol = codec == storage::Codec::bf16 ? 1e-2 : 6e-2;
      for (std::size_t i = 0; i < got.size(); ++i) {
        const std::vector<float> a = got[i].to_vector(), b = ref[i].to_vector();
        double num = 0, den = 0;
        for (std::size_t j = 0; j < a.size(); ++j) {
          num += (a[j] - b[j]) * (a[j] - b[j]);
          den += b[j] * b[j];
        }
        CHECK(std::sqrt(num / std::max(den, 1e-30)) < tol);
      }
    }
  }
  // While a step runs, compressed residuals are counted (and take a fraction of their size).
  const storage::TransferStats coded_before = storage::transfer_stats();
  storage::StoredArray s = storage::StoredArray::store(random_array(Shape{64, 64}, 9), {.codec = storage::Codec::int8});
  const auto st = memory::stats();
  CHECK(st.compressed_original_bytes >= 64 * 64 * 4);
  CHECK(st.compressed_bytes * 3 < st.compressed_original_bytes);
  (void)s.get();
  const storage::TransferStats coded = storage::transfer_stats() - coded_before;  // timed, by uncompressed bytes
  CHECK(coded.encoded_bytes == 64 * 64 * 4);
  CHECK(coded.decoded_bytes == 64 * 64 * 4);
  CHECK(coded.encode_seconds > 0);
}

TEST_CASE("under a live-byte cap an eighth of the plain step's peak, offloading runs the step with its gradients bit for bit") {
  SpillDir spill;
  struct Deep {
    Array operator()(Scope& s, Array x) const {
      for (int i = 0; i < 48; ++i) x = x + gelu(s(nn::Dense{.features = 64}, x)) * 0.25f;
      return x;
    }
  };
  const Array x = random_array(Shape{2048, 64}, 11);
  const Tree params = init(Deep{}, rng::key(0), x).at("params");
  auto loss = [&](const Tree& p) { return mean(square(apply(Deep{}, Tree{{"params", p}}, x))); };
  memory::release_cached();
  const std::int64_t base = memory::stats().live_bytes;
  std::int64_t plain_peak = 0;
  Array v0;
  Tree g0;
  {
    memory::PeakScope peak;
    std::tie(v0, g0) = value_and_grad(loss)(params);
    plain_peak = peak.peak_bytes();
  }
  const std::int64_t cap = plain_peak / 8;
  CAPTURE(plain_peak);
  CAPTURE(base);
  REQUIRE(cap > base + 8 * 2048 * 64 * 4);  // room for the arrays alive anyway and a layer's work
  {
    memory::LiveLimitScope limit(cap);
    CHECK_THROWS_AS(value_and_grad(loss)(params), MemoryError);  // the cap bites without offload
  }
  memory::LiveLimitScope limit(cap);
  lift::ResidualScope offload(policies::offload(policies::everything_saveable{}));
  memory::PeakScope peak;
  const auto [v, g] = value_and_grad(loss)(params);
  CHECK(peak.peak_bytes() <= cap);
  CHECK(v.bitwise_equal(v0));
  CHECK(bitwise_equal(g, g0));
}

TEST_CASE("the memory timeline draws the spill file as its own curve") {
  const fs::path dir = fresh_dir("timeline");
  storage::set_spill_options({.directory = dir, .write_behind_bytes = 0});  // each put waits for its write
  const Case c = models()[0];
  const Tree params = c.init_params();
  memory::TimelineRecorder recorder("offload");
  {
    lift::ResidualScope scope(policies::offload(policies::everything_saveable{}));
    (void)grads_of(c, params);
  }
  const memory::Timeline t = recorder.finish();
  CHECK(t.offloaded_peak_bytes() > 0);
  CHECK(t.points.back().offloaded_bytes == 0);  // all read back and freed by the end of the step
  const memory::Timeline back = memory::Timeline::from_json(t.to_json());
  CHECK(back.offloaded_peak_bytes() == t.offloaded_peak_bytes());
  const std::string svg = memory::render_svg({t});
  CHECK(svg.find("offload (spill file)") != std::string::npos);
  CHECK(svg.find("spill file (dashed): peak") != std::string::npos);
  storage::set_spill_options({.directory = dir});
  fs::remove_all(dir);
}

TEST_CASE("the spill file under churn: values freed while queued or written, prefetches, reverse reads") {
  // (Also run under ThreadSanitizer: the I/O thread and the caller share the file's state.)
  const fs::path dir = fresh_dir("churn");
  storage::set_spill_options({.directory = dir, .write_behind_bytes = 1 << 16, .read_ahead_bytes = 1 << 17});
  std::mt19937 gen(1);
  for (int round = 0; round < 8; ++round) {
    std::vector<storage::StoredArray> stored;
    std::vector<Array> want;
    for (int i = 0; i < 60; ++i) {
      const auto n = static_cast<std::int64_t>(1 + gen() % 20000);
      const Array a = Array::full(Shape{n}, static_cast<float>(gen() % 1000));
      const storage::Placement p = i % 3 == 0   ? storage::Placement{storage::Where::disk}
                                   : i % 3 == 1 ? storage::Placement{storage::Where::disk, storage::Codec::int8}
                                                : storage::Placement{};
      stored.push_back(storage::StoredArray::store(a, p));
      want.push_back(p.lossless() ? a : storage::decompress(storage::compress(a, p.codec)));
      if (gen() % 7 == 0) {  // free one early, maybe while it is being written
        const std::size_t k = gen() % stored.size();
        stored[k] = storage::StoredArray();
      }
    }
    for (std::size_t i = stored.size(); i-- > 0;) {
      if (!stored[i].defined()) continue;
      if (i > 0) stored[i - 1].prefetch();
      CHECK(stored[i].get().bitwise_equal(want[i]));
      stored[i] = storage::StoredArray();
    }
    storage::spill_file().flush();
    CHECK(storage::spill_file().used_bytes() == 0);
  }
  storage::set_spill_options({.directory = dir});
  fs::remove_all(dir);
}

TEST_CASE("split_batch: a call run on slices of its batch gives the plain gradients up to rounding and a smaller peak") {
  SpillDir spill;
  storage::SpillWindowsScope timing_independent({0, 0});
  struct Wide {
    Array operator()(Scope& s, const Array& x) const {
      return s(nn::Dense{.features = 16}, gelu(s(nn::Dense{.features = 512}, s(nn::LayerNorm{}, x))));
    }
  };
  struct Net {
    Array operator()(Scope& s, const Array& x) const {
      const Array h = s(Wide{}, x);
      return s(Attention{}, reshape(h, {16, 8, 16}));
    }
  };
  const Array x = random_array(Shape{128, 16}, 31);
  const Tree params = init(Net{}, rng::key(0), x).at("params");
  auto loss = [&](const Tree& p) { return mean(square(apply(Net{}, Tree{{"params", p}}, x))); };
  auto run = [&](const lift::Policy& policy) {
    lift::RematScope scope({.mode = lift::RematMode::full, .policy = policy});
    memory::release_cached();
    memory::PeakScope peak;
    auto [v, g] = value_and_grad(loss)(params);
    return std::tuple(v, g, peak.peak_bytes());
  };
  const auto [v0, g0] = value_and_grad(loss)(params);
  const std::vector<Array> want = leaves(g0);
  for (const lift::Policy& each : {lift::Policy(policies::nothing_saveable{}),
                                   policies::residuals(policies::offload(policies::everything_saveable{})),
                                   policies::offload(policies::nothing_saveable{})}) {
    const lift::Policy split = policies::split_batch(4, each);
    CAPTURE(split.description());
    CHECK(split.batch_splits() == 4);
    CHECK(policies::from_description(split.description()).description() == split.description());
    CHECK(policies::from_description(split.description()).batch_splits() == 4);
    const auto [v1, g1, whole_peak] = run(each);
    const auto [v, g, split_peak] = run(split);
    CHECK(std::abs(v.item() - v0.item()) <= 1e-5f * std::abs(v0.item()));
    const std::vector<Array> got = leaves(g);
    REQUIRE(got.size() == want.size());
    for (std::size_t i = 0; i < got.size(); ++i)  // parameter gradients are sums over the slices: rounding only
      CHECK(max(abs(got[i] - want[i])).item() <= 1e-4f * max(abs(want[i])).item() + 1e-7f);
    CHECK(split_peak < whole_peak);  // each slice's backward pass works on a quarter of the rows
  }
  // Outputs without a row per example cannot be joined; other transforms refuse the policy.
  struct Pooled {
    Array operator()(Scope& s, const Array& h) const { return mean(s(nn::Dense{.features = 4}, h), {0}); }
  };
  struct PooledNet {
    Array operator()(Scope& s, const Array& h) const { return s(Pooled{}, h); }
  };
  const Tree pooled = init(PooledNet{}, rng::key(0), x).at("params");
  {
    lift::RematScope scope({.mode = lift::RematMode::full, .policy = policies::split_batch(2, policies::nothing_saveable{})});
    const std::string msg = linum::testing::error_of<ValueError>(
        [&] { (void)value_and_grad([&](const Tree& p) { return sum(apply(PooledNet{}, Tree{{"params", p}}, x)); })(pooled); });
    CHECK(linum::testing::contains(msg, "Pooled_0"));
    CHECK(linum::testing::contains(msg, "row per example"));
  }
  const std::string msg = linum::testing::error_of<ValueError>([&] {
    (void)value_and_grad([&](const Array& a) {
      return sum(checkpoint([](const Array& b) { return tanh(b); }, {.policy = policies::split_batch(2, policies::dots_saveable{})})(a));
    })(x);
  });
  CHECK(linum::testing::contains(msg, "RematScope or lift::PlanScope"));
  // Calls whose result depends on the whole batch are refused, not silently changed: batch
  // statistics, random draws.
  struct Stats {
    Array operator()(Scope& s, const Array& h) const {
      Variable n = s.variable("stats", "sum", [] { return Array::zeros(Shape{}); });
      if (s.is_mutable_collection("stats") && !s.is_initializing()) n.set(n.value() + sum(h));
      return s(nn::Dense{.features = 4}, h);
    }
  };
  struct Drop {
    Array operator()(Scope& s, const Array& h) const { return s(nn::Dropout{.rate = 0.5}, s(nn::Dense{.features = 4}, h), false); }
  };
  struct Outer {
    bool drop = false;
    Array operator()(Scope& s, const Array& h) const { return drop ? s(Drop{}, h) : s(Stats{}, h); }
  };
  for (bool drop : {false, true}) {
    CAPTURE(drop);
    const Tree v = init(Outer{drop}, rng::Streams{{"params", rng::key(0)}, {"dropout", rng::key(1)}}, x);
    lift::RematScope scope({.mode = lift::RematMode::full, .policy = policies::split_batch(2, policies::nothing_saveable{})});
    const std::string err = linum::testing::error_of<ValueError>([&] {
      (void)value_and_grad([&](const Tree& p) {
        Tree vars = v;
        vars.set("params", p);
        return sum(apply(Outer{drop}, vars, {.rngs = {{"dropout", rng::key(3)}}, .mutable_collections = {"stats"}}, x).first);
      })(v.at("params"));
    });
    CHECK(linum::testing::contains(err, drop ? "Drop_0" : "Stats_0"));
    CHECK(linum::testing::contains(err, "whole batch"));
  }
}

TEST_CASE("an array several ops save is placed once: one copy in the spill file, gradients bit for bit") {
  SpillDir spill;
  storage::SpillWindowsScope timing_independent({0, 0});
  const Array a = random_array(Shape{64, 32}, 41);
  const std::vector<Array> w = {random_array(Shape{32, 16}, 42), random_array(Shape{32, 16}, 43), random_array(Shape{32, 16}, 44)};
  // tanh saves its output x, and each matmul saves x too (for its weight's gradient): one buffer, four saves.
  auto loss = [&](const Array& in, const Array& w0, const Array& w1, const Array& w2) {
    const Array x = tanh(in);
    return sum(matmul(x, w0) + matmul(x, w1) + matmul(x, w2));
  };
  const auto r0 = value_and_grad<0, 1, 2, 3>(loss)(a, w[0], w[1], w[2]);
  const std::int64_t before = memory::stats().offload_written_bytes;
  lift::ResidualScope scope(policies::offload(policies::everything_saveable{}));
  const auto r = value_and_grad<0, 1, 2, 3>(loss)(a, w[0], w[1], w[2]);
  CHECK(std::get<0>(r).bitwise_equal(std::get<0>(r0)));  // the value, then the four gradients
  CHECK(std::get<1>(r).bitwise_equal(std::get<1>(r0)));
  CHECK(std::get<2>(r).bitwise_equal(std::get<2>(r0)));
  CHECK(std::get<3>(r).bitwise_equal(std::get<3>(r0)));
  CHECK(std::get<4>(r).bitwise_equal(std::get<4>(r0)));
  CHECK(memory::stats().offload_written_bytes - before == 64 * 32 * 4);  // x once, not four times
}
