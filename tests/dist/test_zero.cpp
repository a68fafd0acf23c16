// Sharded data parallelism (ZeRO stages 0-2) under mpirun -np 1, 2 and 3: every stage ends with
// bitwise the parameters and optimizer state one process computes, for every optimizer whose norms
// run across shards; checkpoints restore on the same and on another rank count (zero_resume.sh).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "dist_model.hpp"

#include <linum/train/distributed/mpi.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <functional>
#include <cstdlib>
#include <filesystem>
#include <optional>

#include <unistd.h>

using namespace linum;

namespace {

dist::Communicator self() { return dist::from_mpi(MPI_COMM_SELF); }

struct Block {
  Array operator()(Scope& s, const Array& x, bool train) const {
    Array h = gelu(s(nn::Dense{.features = 19}, x));
    return s(nn::Dropout{.rate = 0.25}, h, /*deterministic=*/!train);
  }
};

// Odd sizes (slices start anywhere), an annotated kernel, a remat block with dropout, a scalar.
struct ZeroNet {
  Array operator()(Scope& s, const Array& x, bool train) const {
    Array h = s(nn::Dense{.features = 23, .kernel_init = nn::with_partitioning(initializers::lecun_normal(), {"embed", "mlp"})}, x);
    h = s(lift::remat<Block>{}, gelu(h), train);
    Array logits = s(nn::Dense{.features = 7}, h);
    return logits * s.param("temperature", initializers::constant(1.5f), Shape{});
  }
};

Tree zero_params() { return init(ZeroNet{}, rng::key(3), Array::zeros(Shape{2, 13}), false).at("params"); }

Tree zero_batch(std::int64_t rows, std::uint32_t seed) {
  return Tree{{"x", rng::normal(rng::key(seed), Shape{rows, 13})}, {"y", rng::randint(rng::key(seed + 1), Shape{rows}, 0, 7)}};
}

Array zero_loss(const Tree& params, const Tree& batch, rng::Key key) {
  Array logits = apply(ZeroNet{}, Tree{{"params", params}}, {.rngs = {{"dropout", key}}}, batch.at("x").array(), true);
  return mean(nn::softmax_cross_entropy_with_integer_labels(logits, batch.at("y").array()));
}

struct Trained {
  Tree params, state;
};

// What one process computes: DataParallel on this process alone, the optimizer on whole leaves.
Trained one_process(const optim::GradientTransformation& opt, int steps, int micro_batches) {
  dist::DataParallel dp({.micro_batches = micro_batches, .comm = self()});
  Tree params = zero_params(), state = opt.init(params);
  for (int step = 0; step < steps; ++step) {
    auto r = dp.value_and_grad(dist::Loss(zero_loss), params, zero_batch(30, 50 + static_cast<std::uint32_t>(step)),
                               rng::fold_in(rng::key(4), static_cast<std::uint32_t>(step)));
    auto next = opt.step(std::move(params), r.grads, std::move(state));
    params = std::move(next.params);
    state = std::move(next.state);
  }
  return {params, state};
}

void train(dist::ShardedDataParallel& z, int from, int to) {
  for (int step = from; step < to; ++step)
    z.step(dist::Loss(zero_loss), zero_batch(30, 50 + static_cast<std::uint32_t>(step)),
           rng::fold_in(rng::key(4), static_cast<std::uint32_t>(step)));
}

// The first leaf where two trees differ in structure, shape, dtype or bits ("" when equal).
std::string first_difference(const Tree& a, const Tree& b) {
  if (auto d = structure_difference(a, b)) return *d;
  const auto fa = flatten(a), fb = flatten(b);
  for (std::size_t i = 0; i < fa.size(); ++i)
    if (!fa[i].second.bitwise_equal(fb[i].second)) return fa[i].first + " differs";
  return "";
}

float max_abs_difference(const Tree& a, const Tree& b) {
  float worst = 0;
  const auto la = leaves(a), lb = leaves(b);
  for (std::size_t i = 0; i < la.size(); ++i)
    for (std::int64_t e = 0; e < la[i].numel(); ++e) worst = std::max(worst, std::abs(la[i].data()[e] - lb[i].data()[e]));
  return worst;
}

struct Case {
  const char* name;
  optim::GradientTransformation opt;
};

std::vector<Case> optimizers() {
  return {
      {"adam", optim::adam(1e-2)},
      {"clip_by_global_norm + adamw", optim::chain(optim::clip_by_global_norm(0.05), optim::adamw(1e-2))},
      {"lamb (trust ratio per leaf)", optim::lamb(1e-2, 0.9, 0.999, 1e-6, 0.0, 0.01)},
      {"sgd with momentum", optim::sgd(0.1, 0.9)},
      {"apply_if_finite(adam)", optim::apply_if_finite(optim::adam(1e-2), 3)},
      {"block rms (adafactor, unfactored)", optim::adafactor(1e-2, 128, 0.8, 0, true, 1.0, 0.0, 1e-30, false)},
      {"rmsprop (centered, momentum)", optim::rmsprop(1e-2, 0.9, 1e-8, 0.0, true, 0.9)},
      {"adagrad", optim::adagrad(1e-2)},
      {"lion", optim::lion(1e-3)},
      {"adabelief", optim::adabelief(1e-2)},
      {"multi_steps(adam, 2)", optim::multi_steps(optim::adam(1e-2), 2)},
      {"masked decay (by path) + ema", optim::chain(optim::add_decayed_weights(1e-2, [](const std::string& path, const Array&) {
                                                      return path.find("kernel") != std::string::npos;
                                                    }),
                                                    optim::ema(0.9), optim::sgd(0.1))},
      {"nadamw", optim::nadamw(1e-2, 0.9, 0.999, 1e-8, 0.01)},
      {"amsgrad (running maximum)", optim::amsgrad(1e-2)},
      {"radam (rectified from step 5)", optim::radam(1e-2, 0.9, 0.9, 1e-8, 0.0, 4.0)},
      {"yogi", optim::yogi(1e-2)},
      {"adadelta", optim::adadelta(1.0)},
      {"novograd (a second moment per leaf)", optim::novograd(1e-2, 0.9, 0.25, 1e-6, 0.0, 0.01)},
      {"lars (trust ratio per leaf, masked)", optim::lars(0.1, 1e-3, nullptr, 0.001, 0.0, [](const std::string& path, const Array&) {
                                                 return path.find("kernel") != std::string::npos;
                                               })},
      {"adan (the last gradient in the state)", optim::adan(1e-2, 0.98, 0.92, 0.99, 1e-8, 1e-8, 0.01)},
      {"adamaxw", optim::adamaxw(1e-2)},
      {"sign_sgd", optim::sign_sgd(1e-2)},
      {"fromage (trust ratio per leaf)", optim::fromage(1e-2)},
  };
}

}  // namespace

TEST_CASE("the layout: rules pick the annotated axis, others their largest axis, scalars go to the last rank") {
  const Tree vars = init(ZeroNet{}, rng::key(3), Array::zeros(Shape{2, 13}), false);
  const Tree& params = vars.at("params");
  CHECK(params.at_path("Dense_0/kernel").axis_names() == std::vector<std::string>{"embed", "mlp"});
  CHECK(params.at_path("Dense_1/kernel").axis_names().empty());
  const auto listed = nn::logical_axes(vars);
  REQUIRE(listed.size() == 1);
  CHECK(listed[0].first == "params/Dense_0/kernel");

  const dist::ShardLayout by_rules(params, 3, {.rules = {{"embed", "data"}, {"mlp", ""}}});
  const dist::ShardLayout by_default(params, 3);
  auto axis_of = [](const dist::ShardLayout& l, const std::string& path) {
    for (const auto& leaf : l.leaves())
      if (leaf.path == path) return leaf.axis;
    FAIL("no leaf ", path);
    return -1;
  };
  CHECK(axis_of(by_rules, "Dense_0/kernel") == 0);    // "embed" (13) by the rule
  CHECK(axis_of(by_default, "Dense_0/kernel") == 1);  // the largest axis (23)
  CHECK(axis_of(by_default, "Dense_1/kernel") == 0);  // [19, 7]: its largest axis
  // Slices tile the parameter; joined again they are the parameter, bit for bit.
  std::vector<Tree> shards;
  for (int r = 0; r < 3; ++r) shards.push_back(by_rules.shard(params, r));
  CHECK(shards[2].at("temperature").array().shape() == Shape{1});  // held as [1]: the last rank's
  CHECK(shards[0].at("temperature").array().shape() == Shape{0});
  CHECK(shards[2].at_path("Dense_0/kernel").array().shape() == Shape{5, 23});  // 13 = 4 + 4 + 5
  CHECK(bitwise_equal(by_rules.assemble(shards), params));
  CHECK(by_rules.shard_numel(0) + by_rules.shard_numel(1) + by_rules.shard_numel(2) == by_rules.numel());

  struct Misnamed {
    Array operator()(Scope& s, const Array& x) const {
      return x * s.param("w", nn::with_partitioning(initializers::ones(), {"a", "b", "c"}), Shape{x.dim(1)});
    }
  };
  CHECK_THROWS_WITH_AS(init(Misnamed{}, rng::key(3), Array::zeros(Shape{2, 13})), doctest::Contains("one name per axis"),
                       ShapeError);
}

TEST_CASE("every stage, reproducible mode: the parameters and optimizer state one process computes, bit for bit") {
  for (const Case& c : optimizers()) {
    const Trained want = one_process(c.opt, 3, 6);
    for (int stage : {0, 1, 2, 3}) {
      CAPTURE(c.name);
      CAPTURE(stage);
      dist::ShardedDataParallel z(zero_params(), c.opt, {.stage = stage, .data = {.micro_batches = 6}});
      train(z, 0, 3);
      CHECK(first_difference(z.params(), want.params) == "");
      CHECK(first_difference(z.optimizer_state(), want.state) == "");
      dist::check_replicated(z.params(), "the parameters after sharded steps");
    }
  }
}

TEST_CASE("stage 3 with and without overlap (prefetch, gradients sent without waiting): the same bits as one process") {
  const auto opt = optim::adam(1e-2);
  const Trained want = one_process(opt, 3, 6);
  for (bool overlap : {false, true}) {
    CAPTURE(overlap);
    dist::ShardedDataParallel z(zero_params(), opt, {.stage = 3, .data = {.micro_batches = 6, .overlap = overlap}});
    int prefetched = 0;
    for (int step = 0; step < 3; ++step)
      prefetched += z.step(dist::Loss(zero_loss), zero_batch(30, 50 + static_cast<std::uint32_t>(step)),
                           rng::fold_in(rng::key(4), static_cast<std::uint32_t>(step)))
                        .prefetched_gathers;
    CHECK(first_difference(z.params(), want.params) == "");
    // Gathers are prefetched with overlap on several ranks.
    if (overlap && dist::size() > 1) CHECK(prefetched > 0);
    else CHECK(prefetched == 0);
  }
  // Fast mode with overlap: within rounding of one process without it.
  dist::ShardedDataParallel a(zero_params(), opt, {.stage = 3, .data = {.reduction = dist::Reduction::fast, .overlap = false}});
  dist::ShardedDataParallel b(zero_params(), opt, {.stage = 3, .data = {.reduction = dist::Reduction::fast, .overlap = true}});
  for (int step = 0; step < 2; ++step) {
    a.step(dist::Loss(zero_loss), zero_batch(30, 50 + static_cast<std::uint32_t>(step)), rng::key(9));
    b.step(dist::Loss(zero_loss), zero_batch(30, 50 + static_cast<std::uint32_t>(step)), rng::key(9));
  }
  CHECK(max_abs_difference(a.params(), b.params()) < 1e-5f);
}

// Tied weights: one Dense shared by name, called two and three times per micro-batch (the last
// call under remat), and a tied embedding (Embed's lookup and attend, one table).
template <int Calls>
struct Tied {
  Array operator()(Scope& s, const Array& x) const {
    const nn::Dense shared{.features = 7};
    Array h = x;
    for (int c = 0; c < Calls - 1; ++c) h = gelu(s("shared", shared, h));
    return s("shared", lift::remat<nn::Dense>{shared}, h);
  }
};
struct TiedEmbedding {
  Array operator()(Scope& s, const Array& tokens) const {
    const nn::Embed embed{.num_embeddings = 11, .features = 6};
    const Array h = tanh(s("embed", embed, tokens));
    return s.call("embed", &nn::Embed::attend, embed, h);
  }
};

// One read's uses interleaved with another's: autodiff adds a leaf's contributions in arrival
// order, stage 3 each read's first: the same within float rounding, not bit for bit.
struct TiedInterleaved {
  Array operator()(Scope& s, const Array& x) const {
    const Array first = s.param("w", initializers::lecun_normal(), Shape{x.dim(1), x.dim(1)});
    const Array a = gelu(matmul(x, first));
    const Array second = s.param("w", initializers::lecun_normal(), Shape{x.dim(1), x.dim(1)});
    const Array b = gelu(matmul(a, second));
    return matmul(b, first);
  }
};

template <class M>
void check_tied(const Array& example, const Tree& batch, const char* name, bool bitwise = true) {
  CAPTURE(name);
  const auto opt = optim::adam(1e-2);
  const Tree params = init(M{}, rng::key(5), example).at("params");
  auto loss = [](const Tree& p, const Tree& b, rng::Key) {
    const Array out = apply(M{}, Tree{{"params", p}}, b.at("x").array());
    return mean(out * out);
  };
  dist::DataParallel alone({.micro_batches = 6, .comm = self()});
  Tree want = params, state = opt.init(params);
  for (int step = 0; step < 2; ++step) {
    auto r = alone.value_and_grad(dist::Loss(loss), want, batch, rng::key(0));
    auto next = opt.step(std::move(want), r.grads, std::move(state));
    want = std::move(next.params);
    state = std::move(next.state);
  }
  for (bool overlap : {false, true}) {
    CAPTURE(overlap);
    dist::ShardedDataParallel z(params, opt, {.stage = 3, .data = {.micro_batches = 6, .overlap = overlap}});
    for (int step = 0; step < 2; ++step) z.step(dist::Loss(loss), batch, rng::key(0));
    if (bitwise) CHECK(first_difference(z.params(), want) == "");
    else CHECK(max_abs_difference(z.params(), want) < 1e-6f);
  }
}

TEST_CASE("stage 3 with tied weights (a parameter read several times per micro-batch): one process's bits") {
  const Tree x{{"x", rng::normal(rng::key(8), Shape{18, 7})}};
  check_tied<Tied<2>>(Array::zeros(Shape{2, 7}), x, "read twice");
  check_tied<Tied<3>>(Array::zeros(Shape{2, 7}), x, "read three times");
  check_tied<TiedEmbedding>(Array::full_i32(Shape{2, 5}, 0),
                            Tree{{"x", rng::randint(rng::key(9), Shape{18, 5}, 0, 11)}}, "tied embedding");
  check_tied<TiedInterleaved>(Array::zeros(Shape{2, 7}), x, "interleaved uses", /*bitwise=*/false);
}

TEST_CASE("stages 2 and 3 with an aux tree (BatchNorm statistics) average it as DataParallel does") {
  const auto opt = optim::adam(1e-2);
  const dist_test::State s = dist_test::init_state(opt);
  const Tree batch = dist_test::make_batch(24, 5);
  dist::DataParallel alone({.micro_batches = 5, .comm = self()});
  const auto want = alone.value_and_grad(dist::LossWithAux(dist_test::loss_of(s.batch_stats)), s.params, batch, rng::key(1));
  const auto next = opt.step(s.params, want.grads, opt.init(s.params));
  for (int stage : {2, 3}) {
    CAPTURE(stage);
    dist::ShardedDataParallel z(s.params, opt, {.stage = stage, .data = {.micro_batches = 5}});
    const auto got = z.step(dist::LossWithAux(dist_test::loss_of(s.batch_stats)), batch, rng::key(1));
    CHECK(got.loss.bitwise_equal(want.loss));
    CHECK(bitwise_equal(got.aux, want.aux));
    CHECK(first_difference(z.params(), next.params) == "");
  }
  // Sync::per_rank: each rank keeps the aux mean over the rows of its own micro-batches (pieces
  // rank, rank + P, ...), weighted by rows as DataParallel weighs a rank's pieces.
  const auto aux_loss = dist::LossWithAux(dist_test::loss_of(s.batch_stats));
  std::int64_t own_rows = 0;
  for (int m = dist::rank(); m < 5; m += dist::size()) own_rows += 24 * (m + 1) / 5 - 24 * m / 5;
  std::optional<Tree> own;
  for (int m = dist::rank(); m < 5; m += dist::size()) {
    const std::int64_t lo = 24 * m / 5, hi = 24 * (m + 1) / 5;
    Tree piece_batch = tree_map([&](const Array& a) { return slice_axis(a, 0, lo, hi); }, batch);
    const Tree aux = aux_loss(s.params, piece_batch, rng::fold_in(rng::key(1), static_cast<std::uint32_t>(m))).second;
    const float w = static_cast<float>(static_cast<double>(hi - lo) / static_cast<double>(own_rows));
    const Tree weighted = tree_map([w](const Array& a) { return a * Array::full(Shape{}, w); }, aux);
    own = own ? tree_map([](const Array& a, const Array& b) { return a + b; }, *own, weighted) : weighted;
  }
  for (int stage : {2, 3}) {
    CAPTURE(stage);
    dist::ShardedDataParallel z(s.params, opt, {.stage = stage, .data = {.micro_batches = 5, .aux = dist::Sync::per_rank}});
    const auto got = z.step(aux_loss, batch, rng::key(1));
    CHECK(got.loss.bitwise_equal(want.loss));
    CHECK(bitwise_equal(got.aux, *own));
    CHECK(first_difference(z.params(), next.params) == "");
  }
}

TEST_CASE("fast mode: every stage within float rounding of one process") {
  const auto opt = optim::chain(optim::clip_by_global_norm(0.05), optim::adamw(1e-2));
  const Tree params = zero_params();
  // The fast mode's pieces are the ranks' rows with keys fold_in(key, rank): compare with dropout
  // off by evaluating the same loss deterministically.
  auto loss = [](const Tree& p, const Tree& b, rng::Key) {
    Array logits = apply(ZeroNet{}, Tree{{"params", p}}, b.at("x").array(), false);
    return mean(nn::softmax_cross_entropy_with_integer_labels(logits, b.at("y").array()));
  };
  Tree want = params, state = opt.init(params);
  for (int step = 0; step < 3; ++step) {
    auto [value, grads] = value_and_grad([&](const Tree& p) { return loss(p, zero_batch(30, 50 + step), rng::key(0)); })(want);
    auto next = opt.step(std::move(want), grads, std::move(state));
    want = next.params;
    state = next.state;
  }
  for (int stage : {0, 1, 2, 3}) {
    CAPTURE(stage);
    dist::ShardedDataParallel z(params, opt, {.stage = stage, .data = {.reduction = dist::Reduction::fast}});
    for (int step = 0; step < 3; ++step) z.step(dist::Loss(loss), zero_batch(30, 50 + static_cast<std::uint32_t>(step)), rng::key(0));
    CHECK(max_abs_difference(z.params(), want) < 1e-5f);
    dist::check_replicated(z.params(), "the parameters after fast sharded steps");
  }
}

TEST_CASE("per-rank bytes: stages 1 and 2 keep about 1/P of the optimizer state; stage 2 no summed whole gradient") {
  const auto opt = optim::adam(1e-2);
  dist::ShardedDataParallel z0(zero_params(), opt, {.stage = 0, .data = {.micro_batches = 6}});
  dist::ShardedDataParallel z1(zero_params(), opt, {.stage = 1, .data = {.micro_batches = 6}});
  dist::ShardedDataParallel z2(zero_params(), opt, {.stage = 2, .data = {.micro_batches = 6}});
  train(z0, 0, 1);
  train(z1, 0, 1);
  train(z2, 0, 1);
  const int P = dist::size();
  const double whole = static_cast<double>(z0.memory().optimizer_state);
  const auto mine = z1.memory().optimizer_state;
  const std::int64_t params_bytes = z1.layout().numel() * 4;
  // adam: mu and nu of the slices (+ a count); a slice is within one index of 1/P of its parameter.
  double slack = 64;
  for (const auto& l : z1.layout().leaves()) slack += 8.0 * static_cast<double>(l.held_shape().numel() / l.held_shape()[l.axis]);
  CHECK(std::abs(static_cast<double>(mine) - whole / P) <= slack);
  CHECK(static_cast<double>(mine) < whole / P + slack);
  CHECK(z2.memory().optimizer_state == mine);
  CHECK(z0.memory().params == params_bytes);
  CHECK(z1.memory().params == params_bytes + z1.layout().shard_numel(dist::rank()) * 4);
  CHECK(z0.memory().gradients >= params_bytes);
}

TEST_CASE("optimizers that need whole leaves, stage 3 and bad options are refused with a clear error") {
  const Tree params = zero_params();
  if (dist::size() > 1) {  // one rank holds whole leaves: factoring works there
    CHECK_THROWS_WITH_AS(dist::ShardedDataParallel(params, optim::adafactor(1e-2, 4), {.stage = 1}),
                         doctest::Contains("whole shape"), ValueError);
  }
  CHECK_NOTHROW(dist::ShardedDataParallel(params, optim::adafactor(1e-2, 4), {.stage = 0}));
  // Ranks that would cut a parameter differently (here: only rank 0 has the axis names) are told so.
  if (dist::size() > 1) {
    const Tree unnamed = with_leaves(params, leaves(params));
    CHECK_THROWS_WITH_AS(dist::ShardedDataParallel(dist::rank() == 0 ? params : unnamed, optim::adam(1e-3),
                                                   {.stage = 2, .rules = {.rules = {{"embed", "data"}}}}),
                         doctest::Contains("parameter layout"), dist::DistError);
  }
  // An optimizer step that throws leaves the trainer unusable, and says so, until restore().
  const optim::GradientTransformation failing(
      "failing", [](const Tree&) { return Tree(); },
      [](const Tree&, const Tree&, const Tree*) -> optim::UpdateResult { throw ValueError("injected optimizer failure"); });
  dist::ShardedDataParallel broken(params, failing, {.stage = 2, .data = {.micro_batches = 3}});
  CHECK_THROWS_WITH_AS(train(broken, 0, 1), doctest::Contains("injected"), ValueError);
  CHECK_THROWS_WITH_AS(broken.params(), doctest::Contains("restore()"), ValueError);
  CHECK_THROWS_AS(dist::ShardedDataParallel(params, optim::adam(1e-3), {.stage = 5}), ValueError);
  CHECK_THROWS_WITH_AS(dist::ShardedDataParallel(params, optim::dpsgd(0.1, 1.0, 0.5, 0), {.stage = 2}),
                       doctest::Contains("per-example"), ValueError);
}

TEST_CASE("a checkpoint restores on the same rank count and training goes on bit for bit") {
  const auto opt = optim::chain(optim::clip_by_global_norm(0.05), optim::adamw(1e-2));
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / ("linum_zero_" + std::to_string(dist::size()) + "_" +
                                                                             std::to_string(dist::allgather(static_cast<std::uint64_t>(::getpid()))[0]));
  dist::ShardedDataParallel a(zero_params(), opt, {.stage = 2, .data = {.micro_batches = 6}});
  train(a, 0, 2);
  a.save(dir);
  dist::ShardedDataParallel b(zero_params(), opt, {.stage = 2, .data = {.micro_batches = 6}});
  b.restore(dir);
  CHECK(bitwise_equal(b.params(), a.params()));
  train(a, 2, 3);
  train(b, 2, 3);
  CHECK(bitwise_equal(b.params(), a.params()));
  CHECK(bitwise_equal(b.optimizer_state(), a.optimizer_state()));
  // Another optimizer's state does not load.
  dist::ShardedDataParallel c(zero_params(), optim::sgd(0.1, 0.9), {.stage = 2, .data = {.micro_batches = 6}});
  CHECK_THROWS_AS(c.restore(dir), ValueError);
  dist::barrier();
  if (dist::rank() == 0) std::filesystem::remove_all(dir);
}

// A small GPT: token embedding, remat'ed pre-norm blocks (causal self-attention, MLP), untied head.
struct GptBlock {
  Array operator()(Scope& s, const Array& x) const {
    Array h = x + s(nn::MultiHeadDotProductAttention{.num_heads = 4}, s(nn::LayerNorm{}, x), nn::AttentionArgs{.is_causal = true});
    Array m = s(nn::Dense{.features = 4 * x.dim(-1),
                          .kernel_init = nn::with_partitioning(initializers::lecun_normal(), {"embed", "mlp"})},
                s(nn::LayerNorm{}, h));
    return h + s(nn::Dense{.features = x.dim(-1),
                           .kernel_init = nn::with_partitioning(initializers::lecun_normal(), {"mlp", "embed"})},
                 gelu(m));
  }
};
// Blocks: lift::remat<GptBlock> (rematted) or GptBlock (the remat planner decides).
template <class Block>
struct GptOf {
  Array operator()(Scope& s, const Array& tokens) const {
    Array h = s(nn::Embed{.num_embeddings = 64, .features = 48}, tokens);
    for (int b = 0; b < 4; ++b) h = s(Block{}, h);
    return s(nn::Dense{.features = 64}, s(nn::LayerNorm{}, h));
  }
};
using Gpt = GptOf<lift::remat<GptBlock>>;
using GptPlain = GptOf<GptBlock>;

template <class Model>
Array gpt_loss_of(const Tree& params, const Tree& batch, rng::Key) {
  const Array logits = apply(Model{}, Tree{{"params", params}}, batch.at("x").array());
  return mean(nn::softmax_cross_entropy_with_integer_labels(logits, batch.at("y").array()));
}
Array gpt_loss(const Tree& params, const Tree& batch, rng::Key key) { return gpt_loss_of<Gpt>(params, batch, key); }
Array gpt_plain_loss(const Tree& params, const Tree& batch, rng::Key key) { return gpt_loss_of<GptPlain>(params, batch, key); }

// `rows` sequences of 16 tokens (and their next tokens).
Tree gpt_batch(int step, std::int64_t rows = 12, std::uint32_t seed = 60) {
  const Array t = rng::randint(rng::key(seed + static_cast<std::uint32_t>(step)), Shape{rows, 17}, 0, 64);
  return Tree{{"x", slice_axis(t, 1, 0, 16)}, {"y", slice_axis(t, 1, 1, 17)}};
}

// The checksum of the parameters one process trains (DataParallel alone, no cap, no remat plan).
template <class Model>
std::string gpt_one_process(const dist::Loss& loss, const Model& model, const optim::GradientTransformation& opt, int steps,
                            int pieces, const std::function<Tree(int)>& batch) {
  dist::DataParallel alone({.micro_batches = pieces, .comm = self()});
  Tree p = init(model, rng::key(21), Array::full_i32(Shape{2, 16}, 0)).at("params"), state = opt.init(p);
  for (int step = 0; step < steps; ++step) {
    auto r = alone.value_and_grad(loss, p, batch(step), rng::key(0));
    auto next = opt.step(std::move(p), r.grads, std::move(state));
    p = std::move(next.params);
    state = std::move(next.state);
  }
  return dist::checksum_hex(p);
}

TEST_CASE("stage 3 trains a GPT whose parameters + gradients + adam state exceed the per-rank cap, under it, bit for bit") {
  const auto opt = optim::adamw(1e-3);
  constexpr int kSteps = 2, kPieces = 6;
  std::int64_t n = 0;
  for (const Array& a : leaves(init(Gpt{}, rng::key(21), Array::full_i32(Shape{2, 16}, 0)).at("params"))) n += a.numel();
  const std::string want = gpt_one_process(gpt_loss, Gpt{}, opt, kSteps, kPieces, [](int step) { return gpt_batch(step); });
  // One process's parameters, gradients and adam state: 16 bytes per parameter. The cap: 3/4 of it.
  const std::int64_t cap = 12 * n;
  std::optional<dist::ShardedDataParallel> z;
  z.emplace(init(Gpt{}, rng::key(21), Array::full_i32(Shape{2, 16}, 0)).at("params"), opt,
            dist::ShardedDataParallelOptions{.stage = 3, .data = {.micro_batches = kPieces}});
  std::int64_t peak = 0;
  {
    // (On fewer than 3 ranks a slice is a third or more of the model: no cap, the bits are checked.)
    memory::LiveLimitScope limit(dist::size() >= 3 ? cap : memory::live_limit());
    memory::reset_peak();
    for (int step = 0; step < kSteps; ++step) z->step(dist::Loss(gpt_loss), gpt_batch(step), rng::key(0));
    peak = memory::stats().peak_bytes;
    // Stage 0 keeps everything whole: it does not fit.
    if (dist::size() >= 3)
      CHECK_THROWS_AS(dist::ShardedDataParallel(init(Gpt{}, rng::key(21), Array::full_i32(Shape{2, 16}, 0)).at("params"), opt,
                                                {.stage = 0, .data = {.micro_batches = kPieces}}),
                      MemoryError);
  }
  if (dist::rank() == 0)
    std::printf("{\"test\":\"zero3_gpt_under_cap\",\"ranks\":%d,\"params\":%lld,\"one_process_state_bytes\":%lld,"
                "\"cap_bytes\":%lld,\"rank0_peak_live_bytes\":%lld}\n",
                dist::size(), static_cast<long long>(n), static_cast<long long>(16 * n), static_cast<long long>(cap),
                static_cast<long long>(peak));
  if (dist::size() >= 3) CHECK(peak <= cap);
  CHECK(dist::checksum_hex(z->params()) == want);
}

// 48 sequences: micro-batches of 16 rows, whose activations outweigh the gradient slices.
Tree gpt_long_batch(int step) { return gpt_batch(step, 48, 80); }

TEST_CASE("the remat planner meets a per-rank budget at stage 3: one plan on every rank, under it, bit for bit") {
  const auto opt = optim::adamw(1e-3);
  constexpr int kSteps = 2, kPieces = 3;
  const Tree params = init(GptPlain{}, rng::key(21), Array::full_i32(Shape{2, 16}, 0)).at("params");
  const std::string want = gpt_one_process(gpt_plain_loss, GptPlain{}, opt, kSteps, kPieces, gpt_long_batch);
  dist::ShardedDataParallel z(params, opt, {.stage = 3, .data = {.micro_batches = kPieces}});
  // Without a tight budget the plan remats nothing; it tells the step's plain peak (the ranks' largest).
  const std::int64_t base = memory::stats().live_bytes;
  const lift::RematPlan loose = z.plan_remat(dist::Loss(gpt_plain_loss), gpt_long_batch(0), rng::key(0), std::int64_t{1} << 40);
  CHECK(std::none_of(loose.calls.begin(), loose.calls.end(), [](const lift::PlannedCall& c) { return c.policy.has_value(); }));
  const std::int64_t plain = loose.plain_peak_bytes;
  REQUIRE(plain > base);
  // A budget that leaves 65% of what the step adds: the plain step does not fit.
  const std::int64_t budget = base + (plain - base) * 65 / 100;
  const lift::RematPlan plan = z.plan_remat(dist::Loss(gpt_plain_loss), gpt_long_batch(0), rng::key(0), budget);
  CHECK(std::any_of(plan.calls.begin(), plan.calls.end(), [](const lift::PlannedCall& c) { return c.policy.has_value(); }));
  CHECK(plan.measured_peak_bytes <= budget);
  // Every rank holds the same plan.
  const std::string text = plan.to_json().dump();
  const auto hash = static_cast<unsigned long long>(std::hash<std::string>{}(text));
  std::vector<unsigned long long> hashes(static_cast<std::size_t>(dist::size()));
  MPI_Allgather(&hash, 1, MPI_UNSIGNED_LONG_LONG, hashes.data(), 1, MPI_UNSIGNED_LONG_LONG, MPI_COMM_WORLD);
  for (unsigned long long h : hashes) CHECK(h == hash);
  if (dist::rank() == 0)
    std::printf("{\"test\":\"zero3_plan_per_rank_budget\",\"ranks\":%d,\"base_bytes\":%lld,\"plain_peak_bytes\":%lld,"
                "\"budget_bytes\":%lld,\"measured_peak_bytes\":%lld}\n%s",
                dist::size(), static_cast<long long>(base), static_cast<long long>(plain), static_cast<long long>(budget),
                static_cast<long long>(plan.measured_peak_bytes), plan.str().c_str());
  // Training under the plan: the forward and backward passes stay within the budget on this rank,
  // and the parameters are one process's without remat.
  {
    lift::PlanScope apply_plan(plan);
    for (int step = 0; step < kSteps; ++step) {
      const std::int64_t before = memory::stats().live_bytes;
      z.step(dist::Loss(gpt_plain_loss), gpt_long_batch(step), rng::key(0));
      CHECK(before + z.memory().activations <= budget);
    }
  }
  CHECK(dist::checksum_hex(z.params()) == want);
  // No plan fits a budget below what the rank holds: a ValueError on every rank.
  CHECK_THROWS_AS(z.plan_remat(dist::Loss(gpt_plain_loss), gpt_long_batch(0), rng::key(0), base / 2), ValueError);
}

// zero_resume.sh: `-np 3` saves at stage 2 (2 steps), then `-np 2` resumes at stage 3 (1 more step) and must
// print the checksum that 3 steps on one process print.
TEST_CASE("resume across rank counts (driven by zero_resume.sh)") {
  const char* save = std::getenv("LINUM_ZERO_SAVE");
  const char* resume = std::getenv("LINUM_ZERO_RESUME");
  const auto opt = optim::chain(optim::clip_by_global_norm(0.05), optim::adamw(1e-2));
  if (save) {
    dist::ShardedDataParallel z(zero_params(), opt, {.stage = 2, .data = {.micro_batches = 6}});
    train(z, 0, 2);
    z.save(save);
  } else if (resume) {
    dist::ShardedDataParallel z(zero_params(), opt, {.stage = 3, .data = {.micro_batches = 6}});  // another stage, too
    z.restore(resume);
    train(z, 2, 3);
    const Tree params = z.params();  // a collective call at stage 3: every rank makes it
    if (dist::rank() == 0) std::printf("zero_checksum %s\n", dist::checksum_hex(params).c_str());
  } else if (dist::rank() == 0) {
    const Trained want = one_process(opt, 3, 6);
    std::printf("zero_checksum %s\n", dist::checksum_hex(want.params).c_str());
  }
}

int main(int argc, char** argv) { return dist_test::run_doctest(argc, argv); }
