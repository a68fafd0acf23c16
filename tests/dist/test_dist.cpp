// linum::dist under mpirun -np 1, 2 and 3 (tests/meson.build runs all three): the collective calls,
// and data-parallel steps checked against what one process computes.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "dist_model.hpp"

#include <linum/train/distributed/mpi.hpp>

#include <cmath>

using namespace linum;

namespace {

dist::Communicator self() { return dist::from_mpi(MPI_COMM_SELF); }

float max_abs_difference(const Tree& a, const Tree& b) {
  float worst = 0;
  const auto la = leaves(a), lb = leaves(b);
  for (std::size_t i = 0; i < la.size(); ++i)
    for (std::int64_t e = 0; e < la[i].numel(); ++e)
      worst = std::max(worst, std::abs(la[i].data()[e] - lb[i].data()[e]));
  return worst;
}

}  // namespace

TEST_CASE("broadcast gives every rank rank 0's tree; allreduce sums and averages") {
  const int r = dist::rank(), n = dist::size();
  const Tree mine{{"w", Array::full(Shape{3, 2}, static_cast<float>(r + 1))}, {"b", Array::full_i32(Shape{2}, r)}};
  const Tree got = dist::broadcast(mine);
  CHECK(got.at("w").array().data()[0] == 1.0f);
  CHECK(got.at("b").array().data_i32()[1] == 0);
  dist::check_replicated(got, "the broadcast tree");

  const Tree values{{"a", Array::full(Shape{5}, static_cast<float>(r + 1))}, {"b", Array::full(Shape{2, 2}, 2.0f)}};
  const Tree sum = dist::allreduce_sum(values, dist::Communicator(), /*bucket_bytes=*/8);  // several messages
  const Tree avg = dist::allreduce_mean(values);
  CHECK(sum.at("a").array().data()[4] == static_cast<float>(n * (n + 1) / 2));
  CHECK(sum.at("b").array().data()[3] == 2.0f * static_cast<float>(n));
  CHECK(avg.at("a").array().data()[0] == doctest::Approx((n + 1) / 2.0));
  dist::check_replicated(avg, "the averaged tree");
}

TEST_CASE("ranks that hold different trees are named, not silently averaged") {
  const int r = dist::rank(), n = dist::size();
  if (n == 1) return;
  const Tree differs{{"w", Array::full(Shape{2}, r == n - 1 ? 1.0f : 0.0f)}};
  try {
    dist::check_replicated(differs, "parameters");
    FAIL("check_replicated accepted different trees");
  } catch (const dist::DistError& e) {
    CHECK(std::string(e.what()).find("rank(s) " + std::to_string(n - 1)) != std::string::npos);
  }
  const Tree shaped{{"w", Array::full(Shape{r == 0 ? 2 : 3}, 1.0f)}};
  CHECK_THROWS_AS(dist::allreduce_sum(shaped), dist::DistError);
  CHECK_THROWS_AS(dist::allreduce_sum(Tree{{"i", Array::full_i32(Shape{2}, 1)}}), ShapeError);
}

TEST_CASE("reproducible mode: the step's loss, gradients and statistics are the bits one process computes") {
  const auto opt = optim::adam(1e-2);
  const dist_test::State s = dist_test::init_state(opt);
  const Tree batch = dist_test::make_batch(48, 5);
  const rng::Key key = rng::key(11);
  dist::DataParallel world({.micro_batches = 6});
  dist::DataParallel alone({.micro_batches = 6, .comm = self()});
  const auto all = world.value_and_grad(dist::LossWithAux(dist_test::loss_of(s.batch_stats)), s.params, batch, key);
  const auto one = alone.value_and_grad(dist::LossWithAux(dist_test::loss_of(s.batch_stats)), s.params, batch, key);
  CHECK(all.loss.bitwise_equal(one.loss));
  CHECK(bitwise_equal(all.grads, one.grads));
  CHECK(bitwise_equal(all.aux, one.aux));
  CHECK(all.stats.ranks == dist::size());
  dist::check_replicated(all.grads, "gradients");
  // With one micro-batch per... the whole batch as one piece, it is plain value_and_grad.
  dist::DataParallel whole({.micro_batches = 1, .comm = self()});
  const auto w = whole.value_and_grad(dist::LossWithAux(dist_test::loss_of(s.batch_stats)), s.params, batch, key);
  auto [value, aux, grads] = value_and_grad([&](const Tree& p) {
    return dist_test::loss_of(s.batch_stats)(p, batch, rng::fold_in(key, 0));
  })(s.params);
  CHECK(w.loss.bitwise_equal(value));
  CHECK(bitwise_equal(w.grads, grads));
}

TEST_CASE("reproducible mode: three training steps give bitwise the parameters of one process") {
  dist::DataParallel world({.micro_batches = 6});
  dist::DataParallel alone({.micro_batches = 6, .comm = self()});
  const auto a = dist_test::train(world, 3, 48);
  const auto b = dist_test::train(alone, 3, 48);
  CHECK(bitwise_equal(a.params, b.params));
  CHECK(bitwise_equal(a.batch_stats, b.batch_stats));
  dist::check_replicated(a.params, "parameters after 3 steps");
  if (dist::rank() == 0) MESSAGE("params_checksum ", dist::checksum_hex(a.params), " on ", dist::size(), " rank(s)");
}

TEST_CASE("fast mode: gradients of the global batch within float tolerance, the same on every rank") {
  // An MLP without dropout or BatchNorm: the mean of the shards' gradients is the batch's gradient.
  const Tree x = rng::normal(rng::key(1), Shape{50, 16});
  const Tree batch{{"x", x}, {"y", rng::normal(rng::key(2), Shape{50, 4})}};
  const Tree params = init(nn::Sequential{nn::Dense{.features = 32}, nn::Dense{.features = 4}},
                           rng::key(3), x.array()).at("params");
  auto loss = [](const Tree& p, const Tree& b, rng::Key) {
    const Array out = apply(nn::Sequential{nn::Dense{.features = 32}, nn::Dense{.features = 4}}, Tree{{"params", p}},
                            b.at("x").array());
    return mean(square(out - b.at("y").array()));
  };
  for (bool overlap : {true, false}) {
    CAPTURE(overlap);
    dist::DataParallel dp({.reduction = dist::Reduction::fast, .bucket_bytes = 1024, .overlap = overlap});
    const auto r = dp.value_and_grad(dist::Loss(loss), params, batch, rng::key(0));
    auto [value, grads] = value_and_grad([&](const Tree& p) { return loss(p, batch, rng::key(0)); })(params);
    CHECK(r.loss.item() == doctest::Approx(value.item()).epsilon(1e-5));
    CHECK(max_abs_difference(r.grads, grads) < 1e-5f);
    dist::check_replicated(r.grads, "fast-mode gradients");
    if (dist::size() > 1) {
      CHECK(r.stats.bytes_sent >= byte_count(params));
      CHECK(r.stats.messages > 2);  // 1 KiB buckets: several messages
    }
  }
}

TEST_CASE("bad data-parallel settings are refused with what to do") {
  CHECK_THROWS_WITH_AS(dist::DataParallel({.micro_batches = 0}), doctest::Contains("micro_batches"), ValueError);
  if (dist::size() > 1)
    CHECK_THROWS_WITH_AS(dist::DataParallel({.micro_batches = 1}), doctest::Contains("at least as many micro-batches as ranks"),
                         ValueError);
  dist::DataParallel dp({.micro_batches = 6});
  const auto opt = optim::adam(1e-2);
  const dist_test::State s = dist_test::init_state(opt);
  CHECK_THROWS_WITH_AS(dp.value_and_grad(dist::LossWithAux(dist_test::loss_of(s.batch_stats)), s.params,
                                         dist_test::make_batch(4, 1), rng::key(0)),
                       doctest::Contains("cannot be cut into 6 micro-batches"), ShapeError);
  Tree ragged = dist_test::make_batch(12, 1);
  ragged.set("y", Array::full_i32(Shape{11}, 0));
  CHECK_THROWS_WITH_AS(dp.value_and_grad(dist::LossWithAux(dist_test::loss_of(s.batch_stats)), s.params, ragged, rng::key(0)),
                       doctest::Contains("disagree on the batch size"), ShapeError);
}

int main(int argc, char** argv) { return dist_test::run_doctest(argc, argv); }
