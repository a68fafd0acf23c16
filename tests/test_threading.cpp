// The compute environment: subnormals flushed in every thread Linum computes in; parallel regions
// that shrink to the free cores without changing any result.
#include <doctest/doctest.h>
#include <linum/linum.hpp>

#include "testing/threads.hpp"

#include <cmath>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#ifdef _OPENMP
#include <omp.h>
#endif

// LLVM's libomp has these; GNU libgomp does not (the weak references are then null).
extern "C" void kmp_set_blocktime(int milliseconds) __attribute__((weak));
extern "C" int kmp_get_blocktime() __attribute__((weak));

using namespace linum;

TEST_CASE("subnormals are flushed in every thread Linum computes in, unless opted out") {
  REQUIRE(flush_denormals());
  const Array tiny = Array::full(Shape{1 << 19}, 1e-30f);  // large enough for the OpenMP threads to join
  const Array y = tiny * 1e-10f;                           // 1e-40 is subnormal in float32
  CHECK(thread_flushes_denormals());
  for (float v : y.to_vector()) {
    if (v != 0.0f) { CHECK(v == 0.0f); break; }
  }
  set_flush_denormals(false);
  const Array z = tiny * 1e-10f;
  CHECK_FALSE(thread_flushes_denormals());
  bool all_subnormal = true;
  for (float v : z.to_vector()) all_subnormal = all_subnormal && v != 0.0f && std::fpclassify(v) == FP_SUBNORMAL;
  CHECK(all_subnormal);
  set_flush_denormals(true);
  CHECK(thread_flushes_denormals());
  {
    IeeeSubnormalScope exact;
    CHECK_FALSE(thread_flushes_denormals());
  }
  CHECK(thread_flushes_denormals());
}

TEST_CASE("openmp_wait_policy reports what the environment gives the OpenMP runtime") {
  const char* policy = std::getenv("OMP_WAIT_POLICY");
  const std::string got = openmp_wait_policy();
  if (policy != nullptr) {
    CHECK(got == policy);
  } else if (kmp_set_blocktime != nullptr) {  // LLVM's libomp
    const char* blocktime = std::getenv("KMP_BLOCKTIME");
    CHECK(got == (blocktime != nullptr ? std::string("KMP_BLOCKTIME=") + blocktime : std::string("unset (libomp spins 1 ms, then sleeps)")));
  } else {
    const char* spin = std::getenv("GOMP_SPINCOUNT");
    CHECK(got == (spin != nullptr ? std::string("GOMP_SPINCOUNT=") + spin : std::string("unset (libgomp spins, then sleeps)")));
  }
}

#ifdef _OPENMP
TEST_CASE("on libomp, idle threads spin 1 ms unless the environment says otherwise") {
  if (kmp_set_blocktime == nullptr) {
    MESSAGE("GNU libgomp: its own environment variables decide");
    return;
  }
  const int before = kmp_get_blocktime();
  (void)team_size();  // what every parallel region of Linum's calls first
  if (std::getenv("KMP_BLOCKTIME") != nullptr || std::getenv("OMP_WAIT_POLICY") != nullptr) CHECK(kmp_get_blocktime() == before);
  else CHECK(kmp_get_blocktime() == 1);
  // The setting is the calling thread's: a thread that starts its own regions gets it too.
  int on_thread = -1;
  std::thread([&] {
    (void)team_size();
    on_thread = kmp_get_blocktime();
  }).join();
  if (std::getenv("KMP_BLOCKTIME") == nullptr && std::getenv("OMP_WAIT_POLICY") == nullptr) CHECK(on_thread == 1);
}
#endif

namespace {
// A CPU-bound child process until killed.
pid_t spin_process() {
  const pid_t pid = fork();
  if (pid == 0) {
    volatile unsigned long x = 0;
    for (;;) x = x + 1;
  }
  return pid;
}
}  // namespace

TEST_CASE("parallel regions shrink to the free cores while other processes hold them") {
#ifdef _OPENMP
  const int max = omp_get_max_threads();
  CHECK(team_size() >= 1);
  CHECK(team_size() <= max);
  // Every core busy with another process: regions run on one thread.
  const long cores = sysconf(_SC_NPROCESSORS_ONLN);
  std::vector<pid_t> spinners;
  for (long i = 0; i < cores; ++i) spinners.push_back(spin_process());
  usleep(100000);
  int seen = max;
  for (int i = 0; i < 40 && seen > 1; ++i) {
    usleep(30000);  // the count is refreshed every 100 ms (and shrinks after two readings)
    seen = team_size();
  }
  CHECK(seen == 1);
  set_adaptive_threads(false);  // a dedicated machine: always the full team
  CHECK(team_size() == max);
  set_adaptive_threads(true);
  for (pid_t p : spinners) kill(p, SIGKILL);
  for (pid_t p : spinners) waitpid(p, nullptr, 0);
#endif
}

TEST_CASE("results do not depend on how many threads run them (what adaptive teams rely on)") {
#ifdef _OPENMP
  // Shapes of the deep MLP and GPT benchmarks, forward and gradient products, in float32 and bf16.
  auto compute = [] {
    std::vector<Array> out;
    for (DType dt : {DType::f32, DType::bf16}) {
      const Array a = astype(rng::normal(rng::key(1), Shape{2048, 512}), dt);
      const Array w = astype(rng::normal(rng::key(2), Shape{512, 768}), dt);
      out.push_back(matmul(a, w));
      out.push_back(matmul(transpose(a, {1, 0}), a));  // a weight gradient: contraction over the batch
      out.push_back(matmul(reshape(a, {4096, 256}), transpose(reshape(w, {1536, 256}), {1, 0})));
      const Array x = reshape(a, {16, 256, 4, 64});
      out.push_back(scaled_dot_product_attention(x, x * 0.5f, x, {.is_causal = true}));
      out.push_back(layer_norm(a, Array(), Array()));
      out.push_back(softmax(a));
      out.push_back(sum(a, {0}));
      out.push_back(sum(a, {1}));
      out.push_back(logsumexp(a, {1}));
      out.push_back(gelu(a) * a + a);
      // The fused LSTM layer, hidden units in two blocks (128 and 32), forward and every gradient: a
      // batch of 12 (the steps by unit blocks across the threads), of 16 (two row pieces) and of 64
      // (four row pieces, two per thread on two threads).
      for (std::int64_t rows : {12, 16, 64}) {
        const Array xs = astype(rng::normal(rng::key(6), Shape{40, rows, 24}), dt);
        const Array wi = astype(rng::normal(rng::key(7), Shape{24, 640}) * 0.2f, dt);
        const Array wh = astype(rng::normal(rng::key(8), Shape{160, 640}) * 0.1f, dt);
        const Array b = astype(rng::normal(rng::key(9), Shape{640}), dt);
        const Array c0 = astype(rng::normal(rng::key(10), Shape{rows, 160}), dt), h0 = c0 * 0.5f;
        // Every step kept, and recomputed in segments (the gates' cotangents then overwrite the
        // recomputed activations; rows of 160 units sit at 64-byte boundaries: computed in place).
        for (std::int64_t segment : {0, 16, 20}) {
          auto [v, g_x, g_wi, g_b, g_wh, g_c0, g_h0] = value_and_grad<0, 1, 2, 3, 4, 5>(
              [segment](const Array& x, const Array& i, const Array& bb, const Array& h, const Array& c, const Array& hh) {
                auto [ys, cl, hl] = lstm_layer(x, i, bb, h, c, hh, {.recompute_segment = segment});
                return sum(astype(square(ys), DType::f32)) + sum(astype(cl, DType::f32));
              })(xs, wi, b, wh, c0, h0);
          for (const Array* g : {&v, &g_x, &g_wi, &g_b, &g_wh, &g_c0, &g_h0}) out.push_back(*g);
        }
      }
      {  // the fused GRU layer, hidden units in two blocks (128 and 32), forward and every gradient
        const Array xs = astype(rng::normal(rng::key(11), Shape{40, 16, 24}), dt);
        const Array wi = astype(rng::normal(rng::key(12), Shape{24, 480}) * 0.2f, dt);
        const Array wh = astype(rng::normal(rng::key(13), Shape{160, 480}) * 0.1f, dt);
        const Array bi = astype(rng::normal(rng::key(14), Shape{480}), dt), bh = bi * 0.5f;
        const Array h0 = astype(rng::normal(rng::key(15), Shape{16, 160}), dt);
        for (bool recompute : {false, true}) {
          auto [v, g_x, g_wi, g_bi, g_wh, g_bh, g_h0] = value_and_grad<0, 1, 2, 3, 4, 5>(
              [recompute](const Array& x, const Array& i, const Array& b, const Array& h, const Array& hb, const Array& hh) {
                auto [ys, hl] = gru_layer(x, i, b, h, hb, hh, {.recompute = recompute});
                return sum(astype(square(ys), DType::f32)) + sum(astype(hl, DType::f32));
              })(xs, wi, bi, wh, bh, h0);
          for (const Array* g : {&v, &g_x, &g_wi, &g_bi, &g_wh, &g_bh, &g_h0}) out.push_back(*g);
        }
      }
      // Products with a narrow output, reached through gradients (the backward pass hands the
      // transposes to the kernel): weight gradients of thin layers and logits layers, whose sums
      // oneDNN would split over threads. And wide layers: in float32 their forward and input-gradient
      // products run on the panel kernel, their weight gradients in row pieces (768 rows: three
      // pieces on two threads; 600: the last of three pieces 88 rows).
      for (auto [batch, in, outs] : {std::array<long, 3>{2048, 64, 64}, {4096, 2048, 16}, {8192, 256, 10}, {512, 1024, 64},
                                     {2048, 512, 520}, {2048, 768, 600}, {2048, 600, 520}}) {
        const Array x = astype(rng::normal(rng::key(3), Shape{batch, in}), dt);
        const Array k = astype(rng::normal(rng::key(4), Shape{in, outs}), dt);
        const Array dy = astype(rng::normal(rng::key(5), Shape{batch, outs}), dt);
        auto [gx, gk] = grad<0, 1>([&](const Array& xx, const Array& kk) { return sum(astype(matmul(xx, kk) * dy, DType::f32)); })(x, k);
        out.push_back(gx);
        out.push_back(gk);
      }
    }
    return out;
  };
  // On exactly two threads and one (adaptive teams would give one thread on a busy machine, and the
  // comparison would then test nothing).
  std::vector<Array> many, one;
  REQUIRE(linum::testing::on_threads(2, [&] { many = compute(); }));
  REQUIRE(linum::testing::on_threads(1, [&] { one = compute(); }));
  REQUIRE(many.size() == one.size());
  for (std::size_t i = 0; i < many.size(); ++i) {
    CAPTURE(i);
    CHECK(many[i].bitwise_equal(one[i]));
  }
#endif
}

TEST_CASE("the LSTM layer's row pieces give the same bits on one, two and three threads") {
#ifdef _OPENMP
  // 16 rows: two pieces (fewer than three threads); 64: four pieces (on three threads, the first
  // thread runs two). A loss of the final carry only (the outputs' cotangent absent) with every step
  // kept, and one of the outputs too with the steps recomputed in segments; float32 and bf16.
  auto compute = [] {
    std::vector<Array> out;
    for (DType dt : {DType::f32, DType::bf16})
      for (std::int64_t rows : {16, 64}) {
        const Array xs = astype(rng::normal(rng::key(21), Shape{20, rows, 24}), dt);
        const Array wi = astype(rng::normal(rng::key(22), Shape{24, 536}) * 0.2f, dt);
        const Array wh = astype(rng::normal(rng::key(23), Shape{134, 536}) * 0.1f, dt);
        const Array b = astype(rng::normal(rng::key(24), Shape{536}), dt);
        const Array c0 = astype(rng::normal(rng::key(25), Shape{rows, 134}), dt), h0 = c0 * 0.5f;
        for (std::int64_t segment : {0, 16}) {
          const bool outputs = segment != 0;
          auto [v, g_x, g_wi, g_b, g_wh, g_c0, g_h0] = value_and_grad<0, 1, 2, 3, 4, 5>(
              [segment, outputs](const Array& x, const Array& i, const Array& bb, const Array& h, const Array& c,
                                 const Array& hh) {
                auto [ys, cl, hl] = lstm_layer(x, i, bb, h, c, hh, {.recompute_segment = segment});
                Array l = sum(astype(cl, DType::f32)) + sum(astype(hl, DType::f32) * 0.5f);
                return outputs ? l + sum(astype(square(ys), DType::f32)) : l;
              })(xs, wi, b, wh, c0, h0);
          for (const Array* g : {&v, &g_x, &g_wi, &g_b, &g_wh, &g_c0, &g_h0}) out.push_back(*g);
        }
      }
    return out;
  };
  std::vector<Array> one, two, three;
  REQUIRE(linum::testing::on_threads(1, [&] { one = compute(); }));
  REQUIRE(linum::testing::on_threads(2, [&] { two = compute(); }));
  REQUIRE(linum::testing::on_threads(3, [&] { three = compute(); }));
  for (std::size_t i = 0; i < one.size(); ++i) {
    CAPTURE(i);
    CHECK(two[i].bitwise_equal(one[i]));
    CHECK(three[i].bitwise_equal(one[i]));
  }
#endif
}

TEST_CASE("convolution gradients do not depend on how many threads run them (data parallelism relies on it)") {
#ifdef _OPENMP
  // The Fashion-MNIST CNN's two convolutions at batch 64: oneDNN's weight gradient sums per thread,
  // so Linum splits the batch into pieces fixed by the shape and sums them in a fixed order.
  auto compute = [] {
    std::vector<Array> out;
    for (DType dt : {DType::f32, DType::bf16}) {
      for (auto [c, o, hw] : {std::tuple{1, 32, 28}, std::tuple{32, 64, 14}}) {
        const Array x = astype(rng::normal(rng::key(3), Shape{64, hw, hw, c}), dt);
        const Array w = astype(rng::normal(rng::key(4), Shape{3, 3, c, o}), dt);
        auto f = [](const Array& x, const Array& w) { return sum(square(astype(conv2d(x, w), DType::f32))); };
        auto [value, gx, gw] = value_and_grad<0, 1>(f)(x, w);
        out.push_back(conv2d(x, w));
        out.push_back(gx);
        out.push_back(gw);
      }
    }
    return out;
  };
  const int max = omp_get_max_threads();
  const auto many = compute();
  std::vector<std::vector<Array>> runs;
  for (int threads : {1, 3}) {
    omp_set_num_threads(threads);
    runs.push_back(compute());
  }
  omp_set_num_threads(max);
  for (const auto& run : runs)
    for (std::size_t i = 0; i < many.size(); ++i) {
      CAPTURE(i);
      CHECK(many[i].bitwise_equal(run[i]));
    }
#endif
}
